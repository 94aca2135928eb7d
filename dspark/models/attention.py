"""Paged attention over a KV pool shared by the target and the drafters.

The pool is one pair of tensors per attention layer, `[num_kv_blocks, kv_block_size, num_kv_heads,
head_dim]`; a request's K/V live in the kv_blocks its block table names, so slot `b * kv_block_size + o`
is offset `o` of kv_block `b`. One step is a flat, variable-length batch of tokens. `AttnMetadata` says
where each new token's K/V go (`slot_mapping`) and, per group of requests, which slots each query reads.

Requests with short queries (decode and verify windows) are padded together into one group; long
prompt chunks get a group each, so a 512-token chunk never pads 8 one-token decodes to 512 rows. In fp32 on
the CPU every group runs the attention kernel of `dspark.kernels` (keys read in place through the slot
table, each query computed on its own: a token's result is the same whatever the chunking and whatever
shares its step); an 8-bit (fp8) pool's rows are upcast to fp32 first and take the same kernel, so fp8 KV is
batch-invariant too; elsewhere gather + SDPA. A flash-attn varlen kernel can replace `paged_attention` on
CUDA without changing the metadata. `tests/test_attention.py` checks it against
dense SDPA over contiguous K/V.

Sliding-window layers (Gemma 3's local layers) read the same pool through `sliding_window_metadata`:
each causal query at position p reads keys (p - window, p] only (`AttnGroup.key_start`), so every
position of a verify window sees its own window. The CPU kernel reads `[0, limit)` of a slot row, so a
windowed group is handed to it as one row per query whose slots start at that query's window
(`AttnGroup.query_rows`); the torch path masks both ends.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dspark import kernels
from dspark.models.recurrent import StateRows

SHORT_QUERY_MAX = 16  # queries up to this length share one padded group


@dataclass
class AttnGroup:
    """Requests whose queries run in one padded SDPA call (or one short-attention kernel call)."""

    token_index: torch.Tensor  # [num_seqs, max_q] long: flat token row of each query (padding → 0)
    query_valid: torch.Tensor  # [num_seqs, max_q] bool
    kv_slots: torch.Tensor  # [num_seqs, max_kv] long: pool slot of each key (padding → 0)
    all_valid: bool  # no query padding: scatter back with a plain reshape
    key_limit: torch.Tensor  # [num_seqs, max_q] long: query j reads keys [0, limit); 0 = padding
    needs_mask: bool = True  # some query sees fewer than all max_kv keys
    causal: bool = True  # every request's queries are causal (key_limit = position + 1)
    key_start: torch.Tensor | None = None  # [num_seqs, max_q] long: query j reads [start, limit) (window)

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[num_seqs, 1, max_q, max_kv] bool, True = may attend (None: all may), built from `key_limit`
        when a torch path first asks (the CPU kernel reads the limits). Padded query rows attend key 0
        only: no NaN, and their rows are discarded."""
        if not self.needs_mask:
            return None
        max_kv = self.kv_slots.shape[1]
        keys = torch.arange(max_kv, device=self.key_limit.device)
        mask = keys < self.key_limit.unsqueeze(-1)  # [num_seqs, max_q, max_kv]
        if self.key_start is not None:
            mask &= keys >= self.key_start.unsqueeze(-1)
        mask[..., 0] |= self.key_limit == 0
        return mask.unsqueeze(1)

    @functools.cached_property
    def query_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A windowed group as one row per valid query: (token_index [n, 1], key_limit [n, 1], kv_slots
        [n, max_window]) whose row r reads the slots of its own window, [start, limit) of the group's row."""
        valid = self.key_limit > 0  # [num_seqs, max_q]
        start = self.key_start[valid]  # [n]
        length = self.key_limit[valid] - start  # [n]
        width = int(length.max()) if length.numel() else 1
        seq = torch.arange(valid.shape[0], device=valid.device).unsqueeze(1).expand_as(valid)[valid]  # [n]
        cols = (start.unsqueeze(1) + torch.arange(width, device=valid.device)).clamp_(
            max=self.kv_slots.shape[1] - 1)  # [n, width]
        return (self.token_index[valid].unsqueeze(1), length.unsqueeze(1),
                self.kv_slots[seq.unsqueeze(1), cols].contiguous())


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: where each token's K/V are stored; -1 = not stored
    groups: list[AttnGroup]
    num_tokens: int
    all_stored: bool = False  # no -1 in slot_mapping: store without a mask (and without a host sync)
    captured: bool = False  # a CUDA graph's step (or its stand-in): no op reads tensor values on the host
    state: StateRows | None = None  # a hybrid target's state slots per request (dspark.models.recurrent)


@dataclass(frozen=True)
class SeqSpec:
    """One request's part of a flat batch, as the runner (or a drafter) sees it."""

    block_table: list[int]  # kv_block ids covering positions [0, num_cached + num_query)
    num_cached: int  # keys already in the pool before this step's tokens (context length)
    num_query: int  # new tokens of this request in the batch, stored at num_cached ..
    token_offset: int  # row of its first new token in the flat batch
    causal: bool = True  # False: the new tokens see each other both ways (a DSpark draft block)
    store: bool = True  # False: queries only, the K/V of these positions are not written
    state_slot: int = -1  # the request's recurrent state slot (hybrid targets); -1: none
    state_from: int = -1  # hybrid targets: the state snapshot its first token starts from (a prefix hit); -1: the slot
    state_saves: tuple[tuple[int, int], ...] = ()  # hybrid targets: (position, snapshot entry) to keep the state of


def slots_for(block_table: list[int], start: int, end: int, kv_block_size: int) -> np.ndarray:
    """[end - start] int64: pool slots of positions [start, end) under a block table."""
    positions = np.arange(start, end)
    blocks = np.asarray(block_table[:-(-end // kv_block_size)], dtype=np.int64)
    return blocks[positions // kv_block_size] * kv_block_size + positions % kv_block_size


def build_attn_metadata(
    seqs: list[SeqSpec], *, num_tokens: int, kv_block_size: int, device: torch.device | str = "cpu"
) -> AttnMetadata:
    """Slot mapping and query groups for a flat batch; numpy → tensors, built once per step."""
    slot_mapping = np.full(num_tokens, -1, dtype=np.int64)
    for s in seqs:
        if s.store:
            slot_mapping[s.token_offset:s.token_offset + s.num_query] = slots_for(
                s.block_table, s.num_cached, s.num_cached + s.num_query, kv_block_size)
    short = [s for s in seqs if s.num_query <= SHORT_QUERY_MAX]
    groups = [_group([s], kv_block_size, device) for s in seqs if s.num_query > SHORT_QUERY_MAX]
    if short:
        groups.append(_group(short, kv_block_size, device))
    state = None
    if any(s.state_slot >= 0 for s in seqs):
        state = StateRows(tuple(s.state_slot for s in seqs), tuple(s.num_cached for s in seqs),
                          tuple(s.num_query for s in seqs), tuple(s.token_offset for s in seqs),
                          tuple(s.state_from for s in seqs), tuple(s.state_saves for s in seqs))
    return AttnMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        groups=groups, num_tokens=num_tokens, all_stored=bool((slot_mapping >= 0).all()), state=state)


def flat_batch(
    chunks: list[tuple[list[int], int, list[int]]], *, kv_block_size: int, device: torch.device | str = "cpu"
) -> tuple[list[int], list[int], AttnMetadata]:
    """(block_table, first position, new token ids) per request → the flat batch's token ids,
    positions and causal attention metadata (the new tokens' K/V stored at those positions)."""
    ids: list[int] = []
    positions: list[int] = []
    seqs: list[SeqSpec] = []
    for block_table, start, tokens in chunks:
        seqs.append(SeqSpec(block_table=block_table, num_cached=start, num_query=len(tokens),
                            token_offset=len(ids)))
        ids.extend(tokens)
        positions.extend(range(start, start + len(tokens)))
    return ids, positions, build_attn_metadata(seqs, num_tokens=len(ids), kv_block_size=kv_block_size,
                                               device=device)


def _group(seqs: list[SeqSpec], kv_block_size: int, device) -> AttnGroup:
    num_query = np.array([s.num_query for s in seqs])  # [num_seqs]
    num_kv = np.array([s.num_cached + s.num_query for s in seqs])
    max_q, max_kv = int(num_query.max()), int(num_kv.max())
    token_index = np.zeros((len(seqs), max_q), dtype=np.int64)
    key_limit = np.zeros((len(seqs), max_q), dtype=np.int64)
    kv_slots = np.zeros((len(seqs), max_kv), dtype=np.int64)
    for i, s in enumerate(seqs):
        n, kv = s.num_query, s.num_cached + s.num_query
        token_index[i, :n] = np.arange(s.token_offset, s.token_offset + n)
        kv_slots[i, :kv] = slots_for(s.block_table, 0, kv, kv_block_size)
        # causal: query j sits at position num_cached + j and sees keys 0 .. num_cached + j
        key_limit[i, :n] = np.arange(s.num_cached + 1, kv + 1) if s.causal else kv
    needs_mask = bool((num_kv < max_kv).any() or (num_query < max_q).any()
                      or any(s.causal and s.num_query > 1 for s in seqs))
    return AttnGroup(
        token_index=torch.from_numpy(token_index).to(device), query_valid=torch.from_numpy(key_limit > 0).to(device),
        kv_slots=torch.from_numpy(kv_slots).to(device), all_valid=bool((num_query == max_q).all()),
        key_limit=torch.from_numpy(key_limit).to(device), needs_mask=needs_mask,
        causal=all(s.causal for s in seqs))


def one_group_metadata(meta: AttnMetadata) -> AttnMetadata:
    """The step's queries as one padded group (the one-call CPU decoder stacks read a single group): each group's
    rows padded to the longest query and key row (padding: key limit 0, read by no query). Every query keeps its
    own keys and limit, so a kernel that computes each query on its own gives the same results. Cached on `meta`."""
    if len(meta.groups) == 1:
        return meta
    if "_one_group" not in meta.__dict__:
        if any(g.key_start is not None for g in meta.groups):
            raise ValueError("one_group_metadata: windowed groups (sliding_window_metadata merges its own)")
        max_q = max(g.token_index.shape[1] for g in meta.groups)
        max_kv = max(g.kv_slots.shape[1] for g in meta.groups)

        def cat(name: str, width: int) -> torch.Tensor:
            return torch.cat([F.pad(getattr(g, name), (0, width - getattr(g, name).shape[1])) for g in meta.groups])
        key_limit = cat("key_limit", max_q)  # [num_seqs, max_q]
        group = AttnGroup(token_index=cat("token_index", max_q), query_valid=key_limit > 0,
                          kv_slots=cat("kv_slots", max_kv), all_valid=False, key_limit=key_limit, needs_mask=True,
                          causal=all(g.causal for g in meta.groups))
        meta.__dict__["_one_group"] = AttnMetadata(slot_mapping=meta.slot_mapping, groups=[group],
                                                   num_tokens=meta.num_tokens, all_stored=meta.all_stored)
    return meta.__dict__["_one_group"]


def sliding_window_metadata(meta: AttnMetadata, window: int, *, trim: bool | None = None) -> AttnMetadata:
    """The metadata of a sliding-window layer over the same step: every causal query at position p
    (key_limit p + 1) reads keys [max(0, p + 1 - window), p + 1). Groups whose queries all lie within
    the window are shared unchanged; the others are cut to their requests' windows (each request's slot
    row starts at the first key any of its queries reads). `trim` (default: on the CPU, outside a captured
    graph) does the cutting, which reads the limits on the host; without it the slot rows stay as they are
    and only the mask changes (no host sync: CUDA graphs capture it). Computed once per step and cached on
    `meta`."""
    trim = meta.slot_mapping.device.type == "cpu" and not meta.captured if trim is None else trim
    cache = meta.__dict__.setdefault("_windows", {})
    if (window, trim) not in cache:
        cache[window, trim] = AttnMetadata(slot_mapping=meta.slot_mapping,
                                           groups=[_window_group(g, window, trim) for g in meta.groups],
                                           num_tokens=meta.num_tokens, all_stored=meta.all_stored,
                                           captured=meta.captured)
    return cache[window, trim]


def _window_group(g: AttnGroup, window: int, trim: bool) -> AttnGroup:
    if not g.causal:
        raise ValueError("a sliding-window layer needs causal queries (key limit = position + 1)")
    valid = g.key_limit > 0  # [num_seqs, max_q]
    start = (g.key_limit - window).clamp_(min=0)  # [num_seqs, max_q] first key each query reads
    if not trim:
        return dataclasses.replace(g, key_start=start, needs_mask=True)
    if not bool((start > 0).any()):
        return g
    big = torch.iinfo(torch.long).max
    lo = torch.where(valid, start, big).min(dim=1).values  # [num_seqs] first key of the request's row
    lo = torch.where(lo == big, 0, lo)
    limit = torch.where(valid, g.key_limit - lo.unsqueeze(1), 0)
    width = int(limit.max())
    cols = (lo.unsqueeze(1) + torch.arange(width, device=lo.device)).clamp_(max=g.kv_slots.shape[1] - 1)
    return AttnGroup(token_index=g.token_index, query_valid=g.query_valid,
                     kv_slots=g.kv_slots.gather(1, cols), all_valid=g.all_valid, key_limit=limit,
                     needs_mask=True, causal=True, key_start=torch.where(valid, start - lo.unsqueeze(1), 0))


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_kv_blocks, kv_block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] long, -1 = skip
    *,
    all_stored: bool = False,  # the caller knows there is no -1: skip the mask (a host sync)
) -> None:
    if not all_stored:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    for new, cache in ((k, k_cache), (v, v_cache)):
        new = new.to(cache.dtype)
        if cache.dtype in FP8:  # 8-bit K/V: copied as their bytes (no fp8 index_copy on the CPU)
            new, cache = new.view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, new)


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def gather_slots(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat[slots] ([num_slots, ...] pool rows by slot); 8-bit pools gathered as their bytes."""
    if flat.dtype in FP8:
        return flat.view(torch.uint8)[slots].view(flat.dtype)
    return flat[slots]


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_kv_blocks, kv_block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    *,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each query over its request's keys in the pool (the new tokens' K/V must be stored
    first, see `store_kv`)."""
    q = q.contiguous()  # a slice of the rotated q|k: the kernel reads rows of H * hd floats
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(q)
    # 8-bit pools take the kernel too, over their rows' keys upcast to fp32 (below): the same per-query
    # arithmetic, so fp8 results do not depend on the batch or the chunking either
    fp8 = k_flat.dtype in FP8
    kernel = kernels.short_attention_applies(q, *((q, q) if fp8 else (k_flat, v_flat)))
    for g in meta.groups:
        num_seqs, max_q = g.token_index.shape
        # the kernel reads slot rows from key 0: a window as one row per query (a host sync, so only where
        # the kernel will run: fp32 CPU tensors, outside a captured graph)
        windowed = g.key_start is not None and not meta.captured and kernel
        rows = g.query_rows if windowed else (g.token_index, g.key_limit, g.kv_slots)
        if kernel and (g.key_start is None or windowed):
            # fp32 CPU, every group (prompt chunks too): the kernel reads the keys in place and computes
            # each query on its own, so a token's attention never depends on how its prompt was chunked
            # or what shared its step (with bf16 products a last-bit difference could flip a rounding)
            if kernels.short_attention(q, *(_upcast_rows(k_flat, v_flat, rows) if fp8 else (k_flat, v_flat, *rows)),
                                       out, scale):
                continue
        qg = q[g.token_index.view(-1)].view(num_seqs, max_q, *q.shape[1:]).transpose(1, 2)
        kg = gather_slots(k_flat, g.kv_slots.view(-1)).view(num_seqs, -1, *k_flat.shape[1:]).transpose(1, 2)
        vg = gather_slots(v_flat, g.kv_slots.view(-1)).view(num_seqs, -1, *v_flat.shape[1:]).transpose(1, 2)
        og = _attend(qg, kg.to(q.dtype), vg.to(q.dtype), g.mask, scale)  # [num_seqs, heads, max_q, head_dim]
        og = og.transpose(1, 2)  # [num_seqs, max_q, num_heads, head_dim]
        if g.all_valid:
            out[g.token_index.view(-1)] = og.reshape(-1, *q.shape[1:])
        else:
            out[g.token_index[g.query_valid]] = og[g.query_valid]
    return out


def _upcast_rows(
    k_flat: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] 8-bit
    v_flat: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # token_index, key_limit, kv_slots [num_seqs, max_kv]
) -> tuple[torch.Tensor, ...]:
    """An 8-bit pool's keys and values that `rows` read, upcast to fp32 ([num_seqs * max_kv, num_kv_heads,
    head_dim] each), with the rows' slots renumbered into them: the short-attention kernel's arguments."""
    token_index, key_limit, kv_slots = rows
    local = torch.arange(kv_slots.numel(), device=kv_slots.device).view_as(kv_slots)
    return (gather_slots(k_flat, kv_slots.view(-1)).float(), gather_slots(v_flat, kv_slots.view(-1)).float(),
            token_index, key_limit, local)


def _attend(
    q: torch.Tensor,  # [num_seqs, num_heads, max_q, head_dim]
    k: torch.Tensor,  # [num_seqs, num_kv_heads, max_kv, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [num_seqs, 1, max_q, max_kv] bool
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, max_q, head_dim]
    """SDPA in fp32 (its fused CPU kernel); for bf16/fp16 the grouped-query matmul path with an fp32
    softmax, which is many times faster than SDPA's reduced-precision CPU path."""
    if q.dtype == torch.float32 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    num_seqs, num_heads, max_q, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # query head h reads kv head h // group: fold the group into the query rows
    qg = q.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [seqs, kv_heads, group*max_q, max_kv]
    if mask is not None:
        m = mask.unsqueeze(2).expand(num_seqs, 1, group, max_q, mask.shape[-1])
        scores = scores.masked_fill(~m.reshape(num_seqs, 1, group * max_q, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(num_seqs, num_heads, max_q, head_dim)
