"""Classic draft-model drafter: a smaller causal LM with the target's tokenizer proposes γ tokens one
at a time.

Two ways to get the draft model (`SpecConfig`):

* `model="path"` — a GGUF file or HF folder loaded with `dspark.models.loader`;
* `model=None, draft_num_layers=N` — a layer-truncated view of the target: its embedding, its first N
  decoder layers, its final norm and its LM head, the same parameter objects (no copies).

The draft model keeps its own K/V in extra layers of the paged pool (one per draft layer), indexed with
the request's block table. Per step:

* `extend_context` runs the draft model over the newly committed positions. A segment's tokens are
  exactly the target's committed inputs there (prompt chunk, or anchor + accepted drafts), so after it
  the draft K/V of every committed position exist (`num_draft_computed = end`). The anchor and the
  accepted drafts were already fed at propose time, but their K/V are recomputed rather than trusted:
  the drafter is stateless across steps, so preemption or block reuse can never leave stale K/V in use.
* `propose` runs γ single-token steps for all requests in one batch each: step k feeds the anchor
  (k = 0) or draft k at position anchor_pos + k, writing scratch K/V there, and samples draft k + 1.
  If the engine reports `num_draft_computed < anchor_pos`, step 0 first catches up over the missing
  committed positions in the same forward.

A truncated view with N = all target layers reproduces the target exactly, so greedy drafts are the
target's own greedy continuation: `tests/test_eagle3_draft_model.py` uses that to check the paged
catch-up and scratch logic.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch
from torch import nn

from dspark.drafters.base import ContextUpdate, DraftProposal, Drafter, ProposeBatch
from dspark.drafters.draft_sampling import DraftAccumulator
from dspark.models.attention import flat_batch
from dspark.models.family import family_of


class DraftModelDrafter(Drafter):
    def __init__(self, draft_model: nn.Module, *, num_draft_tokens: int):
        self.model = draft_model
        self.num_draft_tokens = num_draft_tokens
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.device = next(draft_model.parameters()).device
        self.max_positions = draft_model.config.max_position_embeddings

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        if hasattr(self.model, "kv_layer_specs"):  # per-entry shapes (a Gemma 4 draft model)
            return self.model.kv_layer_specs()
        return [tuple(self.model.kv_spec)] * self.model.num_kv_layers

    def bind_kv(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(kv_caches) != self.model.num_kv_layers:
            raise ValueError(f"draft model has {self.model.num_kv_layers} KV layers, got {len(kv_caches)}")
        self.kv_caches = kv_caches

    # -- forward over several requests' chunks --------------------------------------------------------
    def _forward(self, chunks: list[tuple[list[int], int, list[int]]], kv_block_size: int) -> torch.Tensor:
        """chunks: (block_table, first position, token ids) per request; K/V stored at those positions.
        Returns the final-normed hidden of each chunk's last token, [num_chunks, hidden]."""
        dev = self.device
        ids, positions, meta = flat_batch(chunks, kv_block_size=kv_block_size, device=dev)
        last_rows = [end - 1 for end in itertools.accumulate(len(tokens) for _, _, tokens in chunks)]
        pos = torch.tensor(positions, dtype=torch.long, device=dev).clamp_(max=self.max_positions - 1)
        hidden, _ = self.model(torch.tensor(ids, dtype=torch.long, device=dev), pos, meta, self.kv_caches)
        return hidden[torch.tensor(last_rows, dtype=torch.long, device=dev)]

    @torch.inference_mode()
    def extend_context(self, update: ContextUpdate) -> dict[str, int]:
        segs = [s for s in update.segments if s.token_ids]
        if not segs:
            return {}
        kv_block_size = self.kv_caches[0][0].shape[1]  # pool layout [num_kv_blocks, kv_block_size, ...]
        self._forward([(s.block_table, s.start_pos, list(s.token_ids)) for s in segs], kv_block_size)
        return {s.request_id: s.start_pos + len(s.token_ids) for s in segs}

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        reqs = batch.requests
        acc = DraftAccumulator(reqs, method=batch.draft_sample_method)
        # step 0: (catch-up positions +) the anchor at anchor_pos
        chunks = [(r.block_table, r.num_draft_computed,
                   list(r.all_ids[r.num_draft_computed:r.anchor_pos + 1])) for r in reqs]
        hidden = self._forward(chunks, batch.kv_block_size)  # [num_reqs, hidden]
        drafts = acc.sample(self.model.compute_logits(hidden)).tolist()
        for k in range(1, self.num_draft_tokens):
            chunks = [(r.block_table, r.anchor_pos + k, [d]) for r, d in zip(reqs, drafts)]
            hidden = self._forward(chunks, batch.kv_block_size)
            drafts = acc.sample(self.model.compute_logits(hidden)).tolist()
        return acc.proposal()


# -- the layer-truncated view ------------------------------------------------------------------------

def truncated_view(target: nn.Module, num_layers: int) -> nn.Module:
    """A model of the target's class whose modules are the target's own: embedding, decoder layers
    0 .. num_layers - 1, final norm, rotary tables and LM head. Built on the meta device first (no memory),
    then every module is rebound; a parameter left on meta means the target grew a module this function
    does not know, and it fails loudly instead of running with empty weights."""
    from dspark.models import build_model

    cfg = replace(target.config, num_hidden_layers=num_layers)
    view = build_model(cfg, dtype=next(target.parameters()).dtype, device="meta")
    view.model.embed_tokens = target.model.embed_tokens
    view.model.layers = nn.ModuleList(list(target.model.layers[:num_layers]))
    view.model.norm = target.model.norm
    view.model.rotary_emb = target.model.rotary_emb
    view.lm_head = target.lm_head
    left = [n for n, t in list(view.named_parameters()) + list(view.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"truncated draft model: tensors not shared with the target: {', '.join(left)}")
    return view


# -- registry hooks ----------------------------------------------------------------------------------

def check(spec, target_config) -> None:
    """Fail before any weight loads: exactly one of `model` / `draft_num_layers`, a layer count within
    the target's, and a draft vocabulary identical in size (same tokenizer family) to the target's."""
    if spec.model and spec.draft_num_layers is not None:
        raise ValueError(f"draft_model takes either 'model' ({spec.model!r}) or 'draft_num_layers' "
                         f"({spec.draft_num_layers}), not both")
    if not spec.model:
        if spec.draft_num_layers is None:
            raise ValueError("draft_model needs 'model' (a draft checkpoint) or 'draft_num_layers' "
                             "(a layer-truncated copy of the target)")
        family = family_of(target_config.architecture)
        if family.recurrent_state:
            raise ValueError(f"draft_num_layers (a layer view of the target) is not supported for the hybrid "
                             f"{target_config.architecture}: its linear-attention layers would need state slots "
                             f"of their own; pass a draft checkpoint as 'model', or use 'ngram' or 'mtp'")
        if family.no_layer_view:
            raise ValueError(f"draft_num_layers (a layer view of the target) is not supported for "
                             f"{target_config.architecture}: {family.no_layer_view}; pass a draft checkpoint as "
                             f"'model', or use 'ngram'")
        if not 1 <= spec.draft_num_layers <= target_config.num_hidden_layers:
            raise ValueError(f"draft_num_layers={spec.draft_num_layers} is outside [1, target "
                             f"num_hidden_layers={target_config.num_hidden_layers}]")
        return
    from dspark.models.loader import read_model_config

    check_draft_config(read_model_config(spec.model), target_config)


def check_draft_config(draft_config, target_config) -> None:
    if family_of(draft_config.architecture).recurrent_state:
        raise ValueError(f"a hybrid draft model ({draft_config.architecture}) is not supported: its "
                         f"linear-attention layers would need state slots of their own")
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"draft model vocab_size={draft_config.vocab_size} differs from the target's "
                         f"vocab_size={target_config.vocab_size}: the draft model must share the "
                         f"target's tokenizer")
    if (draft_config.bos_token_id is not None and target_config.bos_token_id is not None
            and draft_config.bos_token_id != target_config.bos_token_id):
        raise ValueError(f"draft model bos_token_id={draft_config.bos_token_id} differs from the target's "
                         f"bos_token_id={target_config.bos_token_id}: not the same tokenizer family")


def build(spec, *, target_config, target_model, dtype, device) -> DraftModelDrafter:
    check(spec, target_config)
    if spec.model:
        from dspark.models.loader import load_model

        draft, draft_config, _ = load_model(spec.model, dtype=dtype, device=device)
        check_draft_config(draft_config, target_config)
    else:
        draft = truncated_view(target_model, spec.draft_num_layers)
    return DraftModelDrafter(draft, num_draft_tokens=spec.num_speculative_tokens)
