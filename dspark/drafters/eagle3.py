"""EAGLE-3 drafter on the engine's paged contract (the network is in `eagle3_model.py`).

Indexing. The target tap at position p summarises tokens ≤ p (it is what predicts token p+1). The
drafter row at position p pairs it with the embedding of token p+1 and predicts token p+2; its K/V live
at slot p of the drafter's one extra pool layer. So a committed position p has drafter context only once
token p+1 is known:

* `extend_context` (segment = positions s .. e−1 with their taps): rows s .. e−2 take their next token
  from the segment; row e−1 takes `next_token_id` (after a verify step it is the bonus/recovered token,
  i.e. the next anchor). When `next_token_id` is unknown the fused feature of e−1 is kept *pending* and
  the row is completed later, by the next segment's first token or by `propose` with the anchor. The
  output hidden of the last row is kept for this step's `propose` (its logits are draft 1).
* `propose` (anchor at a = anchor_pos, context rows < a done): draft 1 comes from the row at a−1
  (target feature f_{a−1} + anchor). Draft k+1 (k = 1 .. γ−1) comes from a row at position a+k−1 that
  pairs the embedding of draft k with the drafter's own previous output in place of the missing target
  feature (EAGLE's feature recycling); its K/V are scratch at slot a+k−1 (inside the block table, which
  covers a + γ slots) and are overwritten by the next `extend_context`.

Only state kept between calls: this step's last-row outputs (cleared by every `extend_context`) and
pending features (a few vectors). Caveat, drafts only: after a prefix-cache hit the drafter K/V at the
hit's last position were computed with the *original* request's next token.

Sampling: greedy or probabilistic per request (`draft_sampling.py`); `draft_probs` over the full target
vocabulary only when some request samples. A reduced draft vocabulary (`d2t`) scores only its rows and
puts −inf logits (probability 0) on every other target id; spec "draft_vocab_size" gives a full-vocabulary
checkpoint one at load (`vocab.py`).
"""

from __future__ import annotations

import logging

import torch

from dspark.drafters.base import ContextUpdate, DraftProposal, Drafter, ProposeBatch
from dspark.drafters.checkpoint import check_shapes, config_file, header_shapes, read_config, same_weights
from dspark.drafters.formats import checkpoint_format, header_shapes_speculators
from dspark.drafters.draft_sampling import DraftAccumulator
from dspark.drafters.vocab import draft_vocab_at_load, read_d2t, slices_at_load
from dspark.drafters.eagle3_model import (Eagle3Config, Eagle3Model, default_tap_layer_ids, load_eagle3,
                                          read_eagle3_config, save_eagle3, state_dict_hf, ttt_targets)
from dspark.models.attention import flat_batch
from dspark.models.files import CONFIG_ERRORS, CheckpointError, config_error

log = logging.getLogger(__name__)

__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3Model", "bind_to_target", "build", "check",
           "default_tap_layer_ids", "load_eagle3", "save_eagle3", "ttt_targets"]


class Eagle3Drafter(Drafter):
    def __init__(self, model: Eagle3Model, *, num_draft_tokens: int):
        self.model = model
        self.num_draft_tokens = num_draft_tokens
        self.tap_layer_ids = model.config.tap_layer_ids
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.device = model.fc.weight.device
        self._last: dict[str, tuple[int, torch.Tensor]] = {}  # request → (position, layer output [d])
        self._pending: dict[str, tuple[int, torch.Tensor]] = {}  # request → (position, fused feature [d])

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        return [(self.model.config.num_key_value_heads, self.model.config.head_dim)]

    def bind_kv(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(kv_caches) != 1:
            raise ValueError(f"EAGLE-3 drafter keeps 1 KV layer, got {len(kv_caches)}")
        self.kv_cache = kv_caches[0]

    def _forward(self, chunks: list[tuple[list[int], int, list[int]]], hidden: torch.Tensor,
                 kv_block_size: int) -> torch.Tensor:
        """chunks: (block_table, first position, next tokens) per request, rows in order; hidden
        [num_rows, d] the matching features. Stores K/V at those positions; → outputs [num_rows, d]."""
        dev = self.device
        ids, positions, meta = flat_batch(chunks, kv_block_size=kv_block_size, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev).clamp_(
            max=self.model.rotary_emb.max_positions - 1)
        return self.model(torch.tensor(ids, dtype=torch.long, device=dev), pos, hidden, meta, self.kv_cache)

    def release(self, request_id: str) -> None:
        self._last.pop(request_id, None)
        self._pending.pop(request_id, None)

    @torch.inference_mode()
    def extend_context(self, update: ContextUpdate) -> dict[str, int]:
        self._last = {}
        segs = [s for s in update.segments if s.token_ids]
        if not segs:
            return {}
        if update.taps is None:
            raise ValueError("EAGLE-3 drafter needs the target's taps in ContextUpdate")
        rows = torch.cat([torch.arange(s.tap_rows.start, s.tap_rows.stop) for s in segs])
        rows = rows.to(update.taps.device)
        fused = self.model.fuse(update.taps[rows].to(self.model.fc.weight.dtype))  # [num_rows, d]
        fused_per_seg = torch.split(fused, [len(s.token_ids) for s in segs])
        chunks, feats, last_of = [], [], []
        done: dict[str, int] = {}
        for seg, f in zip(segs, fused_per_seg):
            rid, start, toks = seg.request_id, seg.start_pos, list(seg.token_ids)
            n = len(toks)
            first, next_toks, feat = start, toks[1:], [f[:n - 1]]  # rows start .. start+n-2
            pending = self._pending.pop(rid, None)
            if pending is not None and pending[0] == start - 1:  # complete it with this segment's first token
                first, next_toks, feat = start - 1, [toks[0]] + next_toks, [pending[1][None]] + feat
            if seg.next_token_id is not None:
                next_toks.append(seg.next_token_id)
                feat.append(f[n - 1:])
                done[rid] = start + n
            else:
                self._pending[rid] = (start + n - 1, f[n - 1])
                done[rid] = start + n - 1
            if next_toks:
                chunks.append((seg.block_table, first, next_toks))
                feats.extend(feat)
                last_of.append((rid, first + len(next_toks) - 1, seg.next_token_id is not None))
        if chunks:
            kv_block_size = self.kv_cache[0].shape[1]  # pool layout [num_kv_blocks, kv_block_size, ...]
            out = self._forward(chunks, torch.cat(feats), kv_block_size)  # [num_rows, d]
            row = -1
            for (rid, pos, keep), (_, _, toks) in zip(last_of, chunks):
                row += len(toks)
                if keep:
                    self._last[rid] = (pos, out[row])
        return done

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        reqs = batch.requests
        acc = DraftAccumulator(reqs, method=batch.draft_sample_method)
        hidden: list[torch.Tensor | None] = [None] * len(reqs)
        todo, chunks, feats = [], [], []
        for i, r in enumerate(reqs):
            a = r.anchor_pos
            last = self._last.pop(r.request_id, None)
            if last is not None and last[0] == a - 1:
                hidden[i] = last[1]
                continue
            pending = self._pending.pop(r.request_id, None)
            if pending is None or pending[0] != a - 1:
                raise RuntimeError(f"EAGLE-3 drafter has no context row at position {a - 1} for request "
                                   f"{r.request_id!r} (anchor_pos={a})")
            todo.append(i)
            chunks.append((r.block_table, a - 1, [r.all_ids[a]]))
            feats.append(pending[1][None])
        if todo:  # the row at a−1 still needed the anchor as its next token
            out = self._forward(chunks, torch.cat(feats), batch.kv_block_size)
            for j, i in enumerate(todo):
                hidden[i] = out[j]
        h = torch.stack(hidden)  # [num_reqs, d]
        drafts = acc.sample(self.model.compute_logits(h)).tolist()
        for k in range(1, self.num_draft_tokens):  # draft k at position a+k−1 → draft k+1
            chunks = [(r.block_table, r.anchor_pos + k - 1, [d]) for r, d in zip(reqs, drafts)]
            h = self._forward(chunks, h, batch.kv_block_size)
            drafts = acc.sample(self.model.compute_logits(h)).tolist()
        return acc.proposal()


def bind_to_target(model: Eagle3Model, target_model) -> Eagle3Model:
    """Share the target's input embedding and LM head (frozen, not copied); a reduced draft vocabulary
    gets a frozen copy of the head's rows `d2t` ([draft_vocab, d], what the drafter scores). A checkpoint's
    own embedding / head (`model.own_shared`, DeepSpec and Speculators store them) that holds the target's
    values is dropped for the target's; one that differs is used (logged): the drafter was trained with it."""
    inner = getattr(target_model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        raise TypeError(f"{type(target_model).__name__} exposes no model.embed_tokens to share")
    own = getattr(model, "own_shared", {})
    dtype = model.fc.weight.dtype
    embed, head = inner.embed_tokens, target_model.compute_logits
    rows = (target_model.lm_head.dense_weight(model.d2t.cpu()).detach().contiguous()  # [draft_vocab, d]
            if model.config.reduced_vocab else None)
    if rows is not None:
        head = lambda h: torch.nn.functional.linear(h, rows)  # noqa: E731  [n, d] → [n, draft_vocab]
    for key, target_w in (("embed_tokens.weight", inner.embed_tokens),
                          ("lm_head.weight", target_model.lm_head if rows is None else rows)):
        mine = own.get(key)
        if mine is None:
            continue
        if same_weights(mine, target_w if isinstance(target_w, torch.Tensor) else target_w.dense_weight()):
            continue
        log.warning("EAGLE-3 checkpoint: its %s differs from the target's: the checkpoint's own is used", key)
        mine = mine.to(device=model.fc.weight.device, dtype=dtype)
        if key == "embed_tokens.weight":
            embed = lambda ids, w=mine: torch.nn.functional.embedding(ids, w)  # noqa: E731
        else:
            head = lambda h, w=mine: torch.nn.functional.linear(h.to(w.dtype), w)  # noqa: E731
    model.own_shared = {}
    return model.bind_target(embed=embed, lm_head=head)


# -- registry hooks ----------------------------------------------------------------------------------

def check(spec, target_config) -> None:
    """Fail before any weight loads: the checkpoint's geometry must fit the target."""
    if spec.draft_num_layers not in (None, 1):
        raise ValueError(f"EAGLE-3 has exactly one draft layer; draft_num_layers={spec.draft_num_layers}")
    cfg = read_eagle3_config(spec.model, num_target_layers=target_config.num_hidden_layers)
    file = config_file(spec.model)
    for field in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(cfg, field), getattr(target_config, field)
        if mine != theirs:
            raise CheckpointError(f"{file}: EAGLE-3 checkpoint {field}={mine} does not match the target's "
                                  f"{field}={theirs}")
    if cfg.target_num_hidden_layers != target_config.num_hidden_layers:
        raise CheckpointError(f"{file}: EAGLE-3 checkpoint was trained on a target with target_num_hidden_layers="
                              f"{cfg.target_num_hidden_layers}; this target has num_hidden_layers="
                              f"{target_config.num_hidden_layers}")
    check_header(spec.model, cfg)
    where = f"EAGLE-3 checkpoint {spec.model!r}"
    read_d2t(spec.model, vocab_size=cfg.vocab_size, where=where)  # the map alone: refused before any weight
    slices_at_load(spec, target_config, checkpoint_draft_vocab=cfg.draft_vocab_size if cfg.reduced_vocab else None,
                   where=where)


def check_header(path: str, cfg: Eagle3Config) -> None:
    """Every tensor name and shape in the safetensors headers (no data read) against the model `cfg`
    describes; a stored embedding / LM head is optional."""
    shapes = header_shapes(path)  # raises naming the folder when it holds no weights
    if checkpoint_format(read_config(path)).startswith("speculators-"):
        shapes = header_shapes_speculators(shapes)
    try:
        required = {k: list(v.shape) for k, v in state_dict_hf(Eagle3Model(cfg, device="meta")).items()}
    except CONFIG_ERRORS as e:  # a config no module is built from (an unknown rope_scaling type, ...)
        raise config_error(config_file(path), e) from None
    d, vocab = cfg.hidden_size, cfg.vocab_size
    optional = {"embed_tokens.weight": [vocab, d], "lm_head.weight": [cfg.draft_vocab_size or vocab, d]}
    check_shapes(required, shapes, optional=optional, where=f"EAGLE-3 checkpoint {path!r}")


def build(spec, *, target_config, target_model, dtype, device) -> Eagle3Drafter:
    check(spec, target_config)
    cfg = read_eagle3_config(spec.model, num_target_layers=target_config.num_hidden_layers)
    keep = draft_vocab_at_load(spec, target_config, checkpoint_draft_vocab=cfg.draft_vocab_size if cfg.reduced_vocab
                               else None, where=f"EAGLE-3 checkpoint {spec.model!r}")
    model = bind_to_target(load_eagle3(spec.model, dtype=dtype, device=device, draft_vocab=keep,
                                       num_target_layers=target_config.num_hidden_layers), target_model)
    return Eagle3Drafter(model.eval(), num_draft_tokens=spec.num_speculative_tokens)
