"""ModelRunner: owns the target model and the paged KV pool, turns a `SchedulerOutput` into one flat
`StepBatch`, and runs the target forward. The only place that builds step tensors for the target.

A step is first `HostBatch` (Python lists: what the tensor-parallel driver broadcasts to its workers,
dspark.distributed.runner), then the device tensors of a `StepBatch`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dspark.models.attention import AttnMetadata, SeqSpec, build_attn_metadata
from dspark.request import SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_dtype(kv_cache_dtype: str, activation_dtype: torch.dtype) -> torch.dtype:
    """The target's KV pool dtype: `--kv-cache-dtype` fp8 variants, else ("auto") the activations'."""
    return FP8_KV_DTYPES.get(kv_cache_dtype, activation_dtype)


def pool_bytes(cache, device: str, *, mem_get_info=None) -> int:
    """Bytes the KV pool may take: `kv_cache_memory_bytes`, or on CUDA with `gpu_memory_utilization` that
    fraction of the device's memory less what is in use now (the weights, loaded before the pool)."""
    if cache.gpu_memory_utilization is None:
        return cache.kv_cache_memory_bytes
    free, total = (mem_get_info or torch.cuda.mem_get_info)(torch.device(device))
    budget = int(cache.gpu_memory_utilization * total) - (total - free)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves no memory for the KV "
                         f"pool ({(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB already in use)")
    return budget


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    attn_meta: AttnMetadata
    logits_indices: torch.Tensor  # [num_logits] long: rows of the batch that become logits
    token_offsets: list[int]  # [num_scheduled] first batch row of each scheduled request
    logits_offsets: list[int]  # [num_scheduled] first logits row of each scheduled request
    input_id_list: list[int]  # the same ids as a Python list (drafter context)
    host: "HostBatch | None" = None  # what the tensors were built from (sent to tensor-parallel workers)


@dataclass
class HostBatch:
    """A step's flat batch as Python data (picklable: what rank 0 sends the tensor-parallel workers)."""

    input_ids: list[int]
    positions: list[int]
    seqs: list[SeqSpec]
    logits_indices: list[int]
    token_offsets: list[int]
    logits_offsets: list[int]
    # the step reads only each logits row's argmax and the runner's head can give it without the rows
    # (the vocabulary-parallel head: each rank's slice winner, merged on rank 0)
    argmax_only: bool = False
    # the last rows of logits_indices score prompt tokens (`ScheduledRequest.prompt_positions`, in item order)
    num_prompt_logits: int = 0


def host_batch(sched: SchedulerOutput, *, argmax_only: bool = False) -> HostBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    seqs: list[SeqSpec] = []
    token_offsets: list[int] = []
    logits_offsets: list[int] = []
    prompt_rows: list[int] = []  # after the emitting rows, so those stay the step's first logits rows
    for item in sched.scheduled:
        req = item.request
        start = item.start_pos
        num_prompt_part = item.num_new_tokens - item.num_drafts
        ids = req.all_ids[start:start + num_prompt_part] + item.draft_ids
        offset = len(input_ids)
        token_offsets.append(offset)
        logits_offsets.append(len(logits_indices))
        seqs.append(SeqSpec(block_table=req.block_table, num_cached=start,
                            num_query=item.num_new_tokens, token_offset=offset,
                            state_slot=-1 if req.state_slot is None else req.state_slot,
                            state_from=item.state_from, state_saves=item.state_saves))
        input_ids.extend(ids)
        positions.extend(range(start, start + item.num_new_tokens))
        if item.emits:
            first = offset + item.num_new_tokens - item.num_logits
            logits_indices.extend(range(first, offset + item.num_new_tokens))
        prompt_rows.extend(offset + p - start for p in item.prompt_positions)
    return HostBatch(input_ids, positions, seqs, logits_indices + prompt_rows, token_offsets, logits_offsets,
                     argmax_only and not prompt_rows, num_prompt_logits=len(prompt_rows))


def cut_rows(seqs: list[SeqSpec], max_rows: int) -> list[tuple[int, int, list[SeqSpec]]] | None:
    """A flat step's rows (`seqs` in row order) as consecutive pieces of at most `max_rows` rows: (first row,
    end row, the piece's requests with row offsets local to it). A causal request's rows may be cut: the rows
    past the cut run later and read the K/V the rows before it stored, as they would in one step (each query's
    attention is its own, whatever else shares its step). None when a request that cannot be cut (a DSpark
    block, a query not stored) has more rows than a piece."""
    pieces: list[tuple[int, int, list[SeqSpec]]] = []
    piece: list[SeqSpec] = []
    start = used = 0  # the current piece's first row, its rows so far

    def close() -> None:
        nonlocal piece, start, used
        if piece:
            pieces.append((start, start + used, piece))
        piece, start, used = [], start + used, 0

    for s in seqs:
        if s.token_offset != start + used:
            return None  # rows out of request order
        cuttable = s.causal and s.store
        if not cuttable and s.num_query > max_rows:
            return None
        if not cuttable and used + s.num_query > max_rows:
            close()
        done = 0
        while done < s.num_query:
            n = min(s.num_query - done, max_rows - used)
            piece.append(dataclasses.replace(s, num_cached=s.num_cached + done, num_query=n, token_offset=used))
            used, done = used + n, done + n
            if used == max_rows:
                close()
    close()
    return pieces


@dataclass
class Caches:
    kv_caches: list  # the target's (k_cache, v_cache) per KV layer
    num_kv_blocks: int  # the block manager's blocks (the pools hold one more: CUDA graphs' padding rows)
    state_bytes: int  # a hybrid target's recurrent state slots and snapshots (0: none)
    num_state_snapshots: int = 0  # a hybrid target's state snapshots for prefix caching (0: none)


def allocate_caches(model: torch.nn.Module, drafter, config) -> Caches:
    """The target's KV pool (and its state slots, for a hybrid target), and the drafter's KV layers, bound to
    it, in one memory budget: `num_kv_blocks`, or the bytes `pool_bytes` allows over what one block of every
    layer takes."""
    dtype = DTYPES[config.dtype]
    target_kv_dtype = kv_dtype(config.cache.kv_cache_dtype, dtype)
    layer_specs = (model.kv_layer_specs() if hasattr(model, "kv_layer_specs")
                   else [model.kv_spec] * model.num_kv_layers)
    draft_specs = drafter.kv_layer_specs() if drafter else []
    kv_block_size = config.cache.kv_block_size
    block_bytes = (kv_bytes_per_block(layer_specs, kv_block_size, target_kv_dtype)
                   + kv_bytes_per_block(draft_specs, kv_block_size, dtype))
    gamma = drafter.num_draft_tokens if drafter else 0
    # a hybrid target's state slots, one per running request, and its prefix cache's state snapshots come out of
    # the same memory budget
    num_snapshots = config.cache.max_state_snapshots if config.cache.enable_prefix_caching else 0
    state_bytes = allocate_state_slots(model, num_slots=config.scheduler.max_num_seqs, window=1 + gamma,
                                       dtype=dtype, device=config.device, num_snapshots=num_snapshots)
    num_kv_blocks = config.cache.num_kv_blocks or max(16, int((pool_bytes(config.cache, config.device)
                                                               - state_bytes) // block_bytes))
    # one block past the block manager's: the padding rows of a replayed CUDA graph store their K/V
    # there (dspark.worker.cuda_graphs), no request ever owns it
    pool = allocate_kv_pool(layer_specs, num_kv_blocks=num_kv_blocks + 1, kv_block_size=kv_block_size,
                            dtype=target_kv_dtype, device=config.device)
    if drafter:
        drafter.bind_kv(allocate_kv_pool(draft_specs, num_kv_blocks=num_kv_blocks + 1,
                                         kv_block_size=kv_block_size, dtype=dtype, device=config.device))
        drafter.bind_target_kv(pool, getattr(model, "cache_index", None))  # read in place (Gemma 4's assistant)
    return Caches(pool, num_kv_blocks, state_bytes, num_snapshots if state_bytes else 0)


def allocate_state_slots(model: torch.nn.Module, *, num_slots: int, window: int, dtype: torch.dtype, device,
                         num_snapshots: int = 0) -> int:
    """A hybrid target's recurrent state slots (`window` kept states each: 1 + the most drafts a window
    verifies) and `num_snapshots` state snapshots (one state each); returns their bytes, 0 for a target without
    linear-attention layers."""
    if not getattr(model, "has_recurrent_state", False):
        return 0
    model.allocate_state(num_slots=num_slots, window=window, dtype=dtype, device=device, num_snapshots=num_snapshots)
    return num_slots * model.state_bytes_per_slot(window, dtype) + num_snapshots * model.state_bytes_per_slot(1, dtype)


def kv_bytes_per_block(layer_specs: list[tuple[int, int]], kv_block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return sum(2 * kv_block_size * heads * dim * elem for heads, dim in layer_specs)


def allocate_kv_pool(layer_specs: list[tuple[int, int]], *, num_kv_blocks: int, kv_block_size: int,
                     dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, each [num_kv_blocks, kv_block_size, heads, head_dim]."""
    return [(torch.zeros(num_kv_blocks, kv_block_size, h, d, dtype=dtype, device=device),
             torch.zeros(num_kv_blocks, kv_block_size, h, d, dtype=dtype, device=device))
            for h, d in layer_specs]


class ModelRunner:
    # Can `forward` give a step's `RowArgmax` for less than its logits rows? Not on one process: the rows
    # are the head's work, their argmax is one more reduction (the verifier takes it). The tensor-parallel
    # runner can: each rank's slice winner instead of the gathered rows (dspark.distributed.runner).
    head_argmax = False

    def __init__(self, model: torch.nn.Module, *, kv_caches, kv_block_size: int, device,
                 tap_layer_ids: tuple[int, ...] = ()):
        self.model = model
        self.kv_caches = kv_caches
        self.kv_block_size = kv_block_size
        self.device = torch.device(device)
        self.tap_layer_ids = tap_layer_ids

    def prepare(self, sched: SchedulerOutput, *, argmax_only: bool = False) -> StepBatch:
        """The step's batch; `argmax_only`: the step reads each logits row's argmax only (then `forward`
        gives a `RowArgmax` where `head_argmax`, else the rows as always)."""
        return self.to_device(host_batch(sched, argmax_only=argmax_only and self.head_argmax))

    def to_device(self, host: "HostBatch") -> StepBatch:
        """The step's tensors on this runner's device (tensor-parallel workers build theirs from the same
        `HostBatch`, so every rank runs the same metadata)."""
        dev = self.device
        return StepBatch(
            input_ids=torch.tensor(host.input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(host.positions, dtype=torch.long, device=dev),
            attn_meta=build_attn_metadata(host.seqs, num_tokens=len(host.input_ids),
                                          kv_block_size=self.kv_block_size, device=dev),
            logits_indices=torch.tensor(host.logits_indices, dtype=torch.long, device=dev),
            token_offsets=host.token_offsets, logits_offsets=host.logits_offsets, input_id_list=host.input_ids,
            host=host)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, *, with_taps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (logits [num_logits, vocab_size] float32, taps [num_tokens, num_taps * hidden] | None: None
        without tap layers or `with_taps`)."""
        tap_ids = self.tap_layer_ids if with_taps else ()
        pieces = self._pieces(batch)
        if pieces is None:
            hidden, taps = self.model(batch.input_ids, batch.positions, batch.attn_meta, self.kv_caches,
                                      tap_layer_ids=tap_ids)
        else:  # consecutive pieces, each all its rows' layers in one CPU stack call
            outs = [self.model(batch.input_ids[a:b], batch.positions[a:b],
                               build_attn_metadata(seqs, num_tokens=b - a, kv_block_size=self.kv_block_size,
                                                   device=self.device), self.kv_caches, tap_layer_ids=tap_ids)
                    for a, b, seqs in pieces]
            hidden = torch.cat([h for h, _ in outs])  # [num_tokens, hidden]
            taps = torch.cat([t for _, t in outs]) if tap_ids else None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return logits.float(), taps

    def _pieces(self, batch: StepBatch) -> list[tuple[int, int, list[SeqSpec]]] | None:
        """A CPU step of more rows than one decoder-stack call takes (`stack_rows`, 128) as consecutive pieces
        that each do, rather than through the per-layer modules (a 512-2048-token prompt's first token
        1.2-1.4x sooner, benchmarks/results/prefill_row_pieces.json); None: one forward. Each row computes what
        it would in a step of its own (tests/test_model_runner.py)."""
        host, rows = batch.host, len(batch.input_id_list)
        max_rows = self.model.stack_rows() if self.device.type == "cpu" and hasattr(self.model, "stack_rows") else 0
        if host is None or not max_rows or rows <= max_rows or self.kv_caches[0][0].dtype != torch.float32 \
                or not all(s.store for s in host.seqs):
            return None
        return cut_rows(host.seqs, max_rows)
