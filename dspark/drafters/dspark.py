"""DSpark drafter (and DFlash = the same class without the Markov and confidence heads) in the
engine's paged KV pool, plus checkpoint check / load / save.

Per step (reference §1.6, §7.2-7.3):
  extend_context: taps of the newly committed positions → H_ctx = hidden_norm(fc(taps)) once → per
      draft layer k_norm(k_proj(H_ctx)) + RoPE and v_proj(H_ctx) stored at those positions' pool slots
      (vLLM's precompute_and_store_context_kv). Nothing else is ever written to the pool.
  propose: one parallel forward of every request's block [anchor, mask × (block_size-1)] at positions
      anchor_pos .. ; each block attends to its request's pool context (positions < anchor_pos, gathered
      through the block table) and to its own block both ways. The block's own K/V stay local, so no
      scratch slot is needed and both slot layouts fit the engine's lookahead. Then the sequential head
      runs left to right over the drafts for all requests at once.

Checkpoints (`dspark_checkpoint.py`, `formats.py`): DeepSpec folders (config.json + safetensors,
reference §3), ours (the same plus `draft_vocab_size` / `d2t`, `slot_layout`, and an optional
`calibration.json`: c_k = σ(z_k / T_k + b_k), per regime) or vLLM Speculators' DSpark / DFlash folders; `d2t`
stored as offsets or absolute ids (`vocab.py`), and spec "draft_vocab_size" reduces a full-vocabulary one at load.
`check` reads config.json and the safetensors headers only and fails before any weight is read. method
"dflash" on a checkpoint with heads uses it with the heads off (DeepSpec's DFlash is exactly that network);
method "dspark" on a checkpoint without a Markov head is an error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dspark.drafters.base import ContextUpdate, DraftProposal, Drafter, ProposeBatch
from dspark.drafters.checkpoint import DTYPE_NAMES
from dspark.drafters.dspark_checkpoint import (CALIBRATION_KEYS, CALIBRATION_NAME, check, check_config,  # noqa: F401
                                               load_dspark, read_calibration, save_dspark, spec_draft_vocab,
                                               without_heads)
from dspark.drafters.dspark_model import DSparkModel
from dspark.drafters.heads import MarkovHead
from dspark import kernels
from dspark.kernels import (cpu_has_bf16_dot, has_bf16w_kernels, has_q4_1_kernels, q4_1_misfit,
                            release_dense_weights, set_matmul_dtype, set_q4_1_products)
from dspark.models.attention import slots_for
from dspark.models.files import read_json_object
from dspark.sampling import greedy_ids, logits_to_probs



# greedy top-K with the vanilla head walks [K, K] bias tables up to this K (above, the per-position loop)
TOPK_TABLE_MAX = 64


class DSparkDrafter(Drafter):
    def __init__(self, model: DSparkModel, *, num_draft_tokens: int,
                 confidence_temperatures: list[float] | None = None,
                 greedy_confidence_temperatures: list[float] | None = None,
                 confidence_biases: list[float] | None = None,
                 greedy_confidence_biases: list[float] | None = None, draft_topk: int = 0,
                 context_window: int | None = None):
        cfg = model.cfg
        if not 1 <= num_draft_tokens <= cfg.max_draft_tokens:
            raise ValueError(f"num_speculative_tokens {num_draft_tokens} must be in [1, "
                             f"{cfg.max_draft_tokens}] (trained block_size {cfg.block_size}, "
                             f"{cfg.slot_layout} layout)")
        self.model = model.eval()
        self.cfg = cfg
        self.num_draft_tokens = num_draft_tokens
        if draft_topk < 0:
            raise ValueError(f"draft_topk must be >= 0, got {draft_topk}")
        # top-K drafting: the Markov head corrects only the K best base logits of each position (0: all)
        self.draft_topk = draft_topk
        # the block attends to the last `context_window` context positions only (None: all of them)
        self.context_window = context_window
        self.tap_layer_ids = cfg.tap_layer_ids
        self.has_confidence = model.confidence_head is not None
        # STS temperatures per regime: requests that sample (temperature > 0) and greedy requests; one
        # shared tensor when the calibration has no separate greedy fit
        self.confidence_temperatures = _temperatures(confidence_temperatures, num_draft_tokens)  # [γ]
        self.greedy_confidence_temperatures = (
            self.confidence_temperatures if greedy_confidence_temperatures is None
            else _temperatures(greedy_confidence_temperatures, num_draft_tokens))  # [γ]
        # optional STS shifts b_k (c_k = σ(z_k / T_k + b_k)), zero unless the calibration fitted them
        self.confidence_biases = per_position(confidence_biases, num_draft_tokens, fill=0.0)  # [γ]
        self.greedy_confidence_biases = (
            self.confidence_biases if greedy_confidence_temperatures is None
            else per_position(greedy_confidence_biases, num_draft_tokens, fill=0.0))  # [γ]
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # anchor_features: the context features H_ctx themselves, per pool slot (halves in the extra K and V)
        self.feature_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        """Per draft layer its context K/V; with anchor_features one more entry whose K and V hold the two
        halves of each position's context feature (the newest one feeds each block's input)."""
        specs = [(self.cfg.num_key_value_heads, self.cfg.head_dim)] * self.cfg.num_hidden_layers
        return specs + ([(1, self.cfg.hidden_size // 2)] if self.cfg.anchor_features else [])

    def bind_kv(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        want = len(self.kv_layer_specs())
        if len(kv_caches) != want:
            raise ValueError(f"got {len(kv_caches)} KV layers for {self.cfg.num_hidden_layers} draft layers "
                             f"(expected {want})")
        self.kv_caches = list(kv_caches[:self.cfg.num_hidden_layers])
        self.feature_rows = kv_caches[-1] if self.cfg.anchor_features else None

    # -- context ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def extend_context(self, update: ContextUpdate) -> dict[str, int]:
        segments = [s for s in update.segments if s.token_ids]
        if not segments:
            return {s.request_id: s.start_pos for s in update.segments}
        if update.taps is None or self.kv_caches is None:
            raise RuntimeError("DSpark drafter needs target taps and a bound KV pool")
        kv_block_size = self.kv_caches[0][0].shape[1]
        rows, positions, slots = [], [], []
        for s in segments:
            n = len(s.token_ids)
            rows.append(torch.arange(s.tap_rows.start, s.tap_rows.start + n))
            positions.append(torch.arange(s.start_pos, s.start_pos + n))  # [n]
            slots.append(torch.from_numpy(slots_for(s.block_table, s.start_pos, s.start_pos + n, kv_block_size)))
        dev = self.device
        taps = update.taps[torch.cat(rows).to(update.taps.device)].to(dev)  # [num_rows, num_taps * hidden]
        slot_mapping = torch.cat(slots).to(dev)  # [num_rows]
        positions = torch.cat(positions).to(dev)  # [num_rows]
        h_ctx = self.model.fused_context_kv(taps, positions, slot_mapping, self.kv_caches)  # K/V stored, or None
        stores = []
        if h_ctx is None:
            h_ctx = self.model.context_features(taps)  # [num_rows, hidden]
            stores = list(zip(self.model.context_kv(taps, positions, h_ctx=h_ctx), self.kv_caches))
        if self.feature_rows is not None:
            half = h_ctx.shape[-1] // 2
            stores.append(((h_ctx[:, None, :half], h_ctx[:, None, half:]), self.feature_rows))
        for (k, v), (k_cache, v_cache) in stores:  # k, v [num_rows, G, hd]
            flat_k = k_cache.view(-1, *k_cache.shape[2:])
            flat_v = v_cache.view(-1, *v_cache.shape[2:])
            flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
            flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return {s.request_id: s.start_pos + len(s.token_ids) for s in update.segments}

    # -- drafting -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_blocks(self, batch: ProposeBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One parallel block forward for all requests → (base_logits [num_reqs, num_draft, draft_vocab]
        fp32, hidden [num_reqs, num_draft, hidden], anchor target ids [num_reqs]). On the CPU, where every
        block's positions have pool slots (the scheduler's lookahead), the fused decoder stack
        (`DSparkModel.fused_backbone`); otherwise the module path over the gathered context."""
        model, reqs = self.model, batch.requests
        kv_block_size = self.kv_caches[0][0].shape[1]
        anchor_pos, anchor_ids = self._anchors(reqs)
        anchor_input = self._anchor_input(reqs, anchor_pos, kv_block_size)  # [num_reqs, hidden] or None
        parts = self._in_fused_parts(reqs, lambda part, tables: model.fused_backbone(
            anchor_ids[part], anchor_pos[part], tables, kv_block_size=kv_block_size, kv_caches=self.kv_caches,
            anchor_input=None if anchor_input is None else anchor_input[part], context_window=self.context_window))
        if parts is not None:
            hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            hidden = self._module_backbone(reqs, anchor_pos, anchor_ids, kv_block_size, anchor_input)
        off = self.cfg.slot_offset
        hidden = hidden[:, off:off + self.num_draft_tokens]  # [num_reqs, num_draft, hidden]
        return model.compute_logits(hidden), hidden, anchor_ids

    def _anchors(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchor positions [num_reqs] long on the CPU, anchor target ids [num_reqs] long)."""
        anchor_pos = torch.tensor([r.anchor_pos for r in reqs], dtype=torch.long)
        return anchor_pos, torch.tensor([r.all_ids[r.anchor_pos] for r in reqs], dtype=torch.long, device=self.device)

    def _in_fused_parts(self, reqs, run) -> list | None:
        """`run(part, tables)` over consecutive slices of the requests, as many as one fused kernel call takes (blocks
        are independent), `tables` the part's block tables [part size, width] long (padding 0) → the parts'
        results; None where the blocks lack pool slots (off the CPU, or past the scheduler's lookahead) or `run`
        returns None (the kernels do not apply, the same for every part)."""
        kv_block_size, size = self.kv_caches[0][0].shape[1], self.cfg.block_size
        if self.device.type != "cpu" or any(len(r.block_table) * kv_block_size < r.anchor_pos + size for r in reqs):
            return None
        per_call, parts = max(1, kernels.MAX_ROWS // size), []
        for i in range(0, len(reqs), per_call):
            chunk = reqs[i:i + per_call]
            width = max(-(-(r.anchor_pos + size) // kv_block_size) for r in chunk)
            tables = np.zeros((len(chunk), width), dtype=np.int64)  # [part size, width]
            for j, r in enumerate(chunk):
                row = r.block_table[:width]
                tables[j, :len(row)] = row
            part = run(slice(i, i + per_call), torch.from_numpy(tables))
            if part is None:
                return None
            parts.append(part)
        return parts

    def _fused_proposal(self, batch: ProposeBatch) -> DraftProposal | None:
        """The greedy proposal with the vanilla Markov head in one kernel call per part (`DSparkModel.fused_proposal`:
        block forward, LM head, Markov walk, confidence head): the per-op path's drafts and confidences bit for bit;
        None where it does not apply."""
        model, reqs = self.model, batch.requests
        head = model.markov_head
        if (head is None or not self._walks_in_kernel(head)
                or not model.fused_proposal_applies(len(reqs) * self.num_draft_tokens)):
            return None
        anchor_pos, anchor_ids = self._anchors(reqs)
        kv_block_size = self.kv_caches[0][0].shape[1]
        anchor_input = self._anchor_input(reqs, anchor_pos, kv_block_size)  # [num_reqs, hidden] or None
        parts = self._in_fused_parts(reqs, lambda part, tables: model.fused_proposal(
            anchor_ids[part], anchor_pos[part], tables, kv_block_size=kv_block_size, kv_caches=self.kv_caches,
            num_draft=self.num_draft_tokens, anchor_input=None if anchor_input is None else anchor_input[part],
            context_window=self.context_window))
        if parts is None:
            return None
        drafts, conf = parts[0] if len(parts) == 1 else (  # [num_reqs, num_draft] target ids and confidence logits
            torch.cat([d for d, _ in parts]), None if parts[0][1] is None else torch.cat([c for _, c in parts]))
        return DraftProposal(draft_ids=drafts, draft_probs=None,
                             confidence=self._confidence(conf, [r.params.is_greedy for r in reqs]))

    def _anchor_input(self, reqs, anchor_pos: torch.Tensor, kv_block_size: int) -> torch.Tensor | None:
        """anchor_features: anchor_proj of each request's newest context feature (position anchor_pos - 1, read
        from the pool; none at position 0), added to every row of the request's block → [num_reqs, hidden], or None
        without it."""
        if self.feature_rows is None:
            return None
        newest = (anchor_pos - 1).clamp(min=0).tolist()
        slots = torch.cat([torch.from_numpy(slots_for(r.block_table, p, p + 1, kv_block_size))
                           for r, p in zip(reqs, newest)]).to(self.device)  # [num_reqs]
        k_cache, v_cache = self.feature_rows
        rows = torch.cat([k_cache.view(-1, k_cache.shape[-1])[slots], v_cache.view(-1, v_cache.shape[-1])[slots]], -1)
        rows = rows.to(self.model.norm.weight.dtype) * (anchor_pos > 0).to(self.device).unsqueeze(-1)  # [num_reqs, hidden]
        return self.model.anchor_proj(rows)

    def _module_backbone(self, reqs, anchor_pos: torch.Tensor, anchor_ids: torch.Tensor, kv_block_size: int,
                         anchor_input: torch.Tensor | None = None) -> torch.Tensor:
        """`DSparkModel.backbone` over each request's context K/V gathered from the pool (nothing stored)
        → [num_reqs, block_size, hidden]."""
        cfg, dev = self.cfg, self.device
        block_ids = self.model.block_ids(anchor_ids)  # [num_reqs, block_size]
        positions = anchor_pos.to(dev).unsqueeze(1) + torch.arange(cfg.block_size, device=dev)  # [num_reqs, block_size]
        # context positions first .. anchor_pos-1 (first: 0, or the window's start) through each request's block table
        first = (torch.zeros_like(anchor_pos) if self.context_window is None
                 else (anchor_pos - self.context_window).clamp(min=0))  # [num_reqs]
        max_ctx = int((anchor_pos - first).max())
        num_tables = max(1, -(-int(anchor_pos.max()) // kv_block_size))
        tables = torch.zeros(len(reqs), num_tables, dtype=torch.long)
        for i, r in enumerate(reqs):
            used = min(len(r.block_table), num_tables)
            tables[i, :used] = torch.tensor(r.block_table[:used], dtype=torch.long)
        pos = first.unsqueeze(1) + torch.arange(max_ctx)  # [num_reqs, max_ctx] context positions
        ctx_valid = pos < anchor_pos.unsqueeze(1)  # [num_reqs, max_ctx]
        pos = torch.where(ctx_valid, pos, 0)
        # [num_reqs, max_ctx] pool slot of each context position (padding → 0)
        ctx_slots = tables.gather(1, pos // kv_block_size) * kv_block_size + pos % kv_block_size
        ctx_slots = torch.where(ctx_valid, ctx_slots, 0).to(dev)
        mask = torch.cat([ctx_valid, torch.ones(len(reqs), cfg.block_size, dtype=torch.bool)], dim=1)
        mask = None if bool(mask.all()) else mask[:, None, None, :].to(dev)  # [num_reqs, 1, 1, keys]

        def layer_context_kv(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            k_cache, v_cache = self.kv_caches[i]
            k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, G, hd]
            v_flat = v_cache.view(-1, *v_cache.shape[2:])
            return k_flat[ctx_slots], v_flat[ctx_slots]  # [num_reqs, max_ctx, G, hd]

        return self.model.backbone(block_ids, positions, layer_context_kv=layer_context_kv, mask=mask,
                                   anchor_input=None if anchor_input is None else anchor_input.unsqueeze(1))

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        model, dev = self.model, self.device
        reqs = batch.requests
        probabilistic = batch.draft_sample_method == "probabilistic"
        if not probabilistic and self.draft_topk == 0:
            fused = self._fused_proposal(batch)
            if fused is not None:
                return fused
        base_logits, hidden, prev = self.forward_blocks(batch)
        greedy_rows = [r.params.is_greedy for r in reqs]
        head = model.markov_head
        state = head.init_state(num_rows=len(reqs), device=dev, dtype=hidden.dtype) if head else None
        cand = None
        if head is not None and self.draft_topk > 0:
            # top-K drafting: each position's K best base logits are its candidates (one call for every
            # position), in draft-id order (ties and sampling as over the whole row), and the head corrects
            # only those: [num_reqs, num_draft, K]
            cand = base_logits.topk(min(self.draft_topk, base_logits.shape[-1]), dim=-1).indices.sort(-1).values
            base_logits = base_logits.gather(-1, cand)
        if cand is not None and not probabilistic and type(head) is MarkovHead and cand.shape[-1] <= TOPK_TABLE_MAX:
            draft_ids, prev_ids = self._greedy_topk_vanilla(head, base_logits, cand, prev)
            conf_logits = model.confidence_logits(hidden, prev_ids=prev_ids)  # [num_reqs, γ]
            return DraftProposal(draft_ids=draft_ids.cpu(), draft_probs=None,
                                 confidence=self._confidence(conf_logits, greedy_rows))
        if head is not None and cand is None and not probabilistic and self._walks_in_kernel(head):
            # the greedy walk of the vanilla head in one kernel call: the loop below's arithmetic
            walked = kernels.markov_walk(base_logits, head.markov_w1.weight, head.markov_w2.weight, model.d2t, prev)
            if walked is not None:
                prev_ids = torch.cat([prev.unsqueeze(1), walked[:, :-1]], dim=1)  # [num_reqs, γ]
                return DraftProposal(draft_ids=walked.cpu(), draft_probs=None, confidence=self._confidence(
                    model.confidence_logits(hidden, prev_ids=prev_ids), greedy_rows))
        draft_ids, draft_probs, prev_ids = [], [], []
        if probabilistic:
            temperature = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=dev)
            top_k = torch.tensor([r.params.top_k for r in reqs], dtype=torch.long, device=dev)
            top_p = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32, device=dev)
        for k in range(self.num_draft_tokens):
            prev_ids.append(prev)
            logits = base_logits[:, k]  # [num_reqs, draft_vocab] fp32, or [num_reqs, K] candidates
            if head is not None:
                logits, state = head.step(base_logits=logits, hidden=hidden[:, k], prev_ids=prev,
                                          state=state, candidates=None if cand is None else cand[:, k])
            if probabilistic:
                probs = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
                tokens = torch.stack([
                    probs[i].argmax() if greedy_rows[i] else
                    _sample(probs[i], r.generator).to(dev)
                    for i, r in enumerate(reqs)])  # [num_reqs] draft-vocab ids (candidate indices)
                if cand is not None:  # the proposal distribution over the whole draft vocabulary
                    probs = probs.new_zeros(len(reqs), self.cfg.effective_draft_vocab_size).scatter_(
                        1, cand[:, k], probs)
                draft_probs.append(probs)
            else:
                tokens = greedy_ids(logits)  # [num_reqs]
            if cand is not None:
                tokens = cand[:, k].gather(1, tokens.view(-1, 1)).squeeze(1)  # candidate index → draft id
            prev = model.d2t[tokens]  # target ids; the next position's predecessor
            draft_ids.append(prev)
        # the confidences read each position's predecessor, not its logits: all positions in one call
        # after the loop (each row the same product as position by position)
        conf_logits = model.confidence_logits(hidden, prev_ids=torch.stack(prev_ids, dim=1))  # [num_reqs, γ]
        return DraftProposal(
            draft_ids=torch.stack(draft_ids, dim=1).cpu(),  # [num_reqs, num_draft]
            draft_probs=self._target_probs(draft_probs) if probabilistic and not all(greedy_rows) else None,
            confidence=self._confidence(conf_logits, greedy_rows))

    @staticmethod
    def _walks_in_kernel(head) -> bool:
        """Whether `kernels.markov_walk` computes what `MarkovHead.step` does: the vanilla head, W2 fp32 without a
        low-precision copy, contiguous (its product is small_mm's fp32 one), W1's rows fp32 or bf16 read back as fp32."""
        w1, w2 = head.markov_w1.weight, head.markov_w2.weight
        return (type(head) is MarkovHead and w2.dtype == torch.float32 and w2.is_contiguous()
                and getattr(head.markov_w2, "lowp_weight", None) is None
                and (w1.dtype == torch.float32 or head.rows_dtype == torch.float32))

    def _greedy_topk_vanilla(self, head, base: torch.Tensor, cand: torch.Tensor, anchor: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy top-K drafting with the vanilla Markov head, every bias in two batched products: position 0's
        candidates against the anchor, position k's against each candidate of position k - 1 (a [K, K] table),
        then a walk of index lookups. base, cand [num_reqs, γ, K]; anchor [num_reqs] target ids →
        (draft target ids [num_reqs, γ], predecessor target ids [num_reqs, γ])."""
        d2t, w2 = self.model.d2t, head.markov_w2.weight  # w2 [draft_vocab, rank]
        rows = torch.nn.functional.embedding(cand, w2)  # [num_reqs, γ, K, rank]
        first = (rows[:, 0] @ head.embed_prev(anchor).to(rows.dtype).unsqueeze(-1)).squeeze(-1)  # [num_reqs, K]
        prev_emb = head.embed_prev(d2t[cand[:, :-1]]).to(rows.dtype)  # [num_reqs, γ-1, K(prev), rank]
        table = rows[:, 1:] @ prev_emb.transpose(-1, -2)  # [num_reqs, γ-1, K(cur), K(prev)]
        pick = greedy_ids(base[:, 0] + first.to(base.dtype))  # [num_reqs] candidate index
        picks = [pick]
        for k in range(1, base.shape[1]):
            bias = table[:, k - 1].gather(2, pick.view(-1, 1, 1).expand(-1, table.shape[2], 1)).squeeze(-1)
            pick = greedy_ids(base[:, k] + bias.to(base.dtype))
            picks.append(pick)
        drafts = d2t[cand.gather(2, torch.stack(picks, dim=1).unsqueeze(-1)).squeeze(-1)]  # [num_reqs, γ]
        return drafts, torch.cat([anchor.unsqueeze(1), drafts[:, :-1]], dim=1)

    def _target_probs(self, draft_probs: list[torch.Tensor]) -> torch.Tensor:
        """[num_draft] × [num_reqs, draft_vocab] → [num_reqs, num_draft, vocab_size] fp32 (target ids)."""
        probs = torch.stack(draft_probs, dim=1)
        if self.cfg.draft_vocab_size is None:
            return probs.cpu()
        full = probs.new_zeros(*probs.shape[:2], self.cfg.vocab_size)
        full[..., self.model.d2t] = probs
        return full.cpu()

    def temperatures_for(self, greedy: bool) -> torch.Tensor:
        """[num_draft] the STS temperatures a greedy / sampling request's confidences are divided by."""
        return self.greedy_confidence_temperatures if greedy else self.confidence_temperatures

    def biases_for(self, greedy: bool) -> torch.Tensor:
        """[num_draft] the STS shifts added after the temperature (zeros for plain STS)."""
        return self.greedy_confidence_biases if greedy else self.confidence_biases

    def _confidence(self, conf_logits: torch.Tensor | None, greedy_rows: list[bool]) -> torch.Tensor | None:
        """σ(z_k / T_k + b_k) [num_reqs, num_draft] (T_k, b_k from calibration.json for the request's
        regime, else 1 and 0), or None (no confidence head)."""
        if conf_logits is None:
            return None
        z = conf_logits.cpu()  # [num_reqs, num_draft] fp32
        if len(set(greedy_rows)) == 1:  # one regime: its [num_draft] vectors broadcast over the rows
            return torch.sigmoid(z / self.temperatures_for(greedy_rows[0]) + self.biases_for(greedy_rows[0]))
        temps = torch.stack([self.temperatures_for(g) for g in greedy_rows])  # [num_reqs, num_draft]
        shifts = torch.stack([self.biases_for(g) for g in greedy_rows])  # [num_reqs, num_draft]
        return torch.sigmoid(z / temps + shifts)


def resolve_matmul_dtype(name: str, *, dtype: torch.dtype, device, q4_1_fits: bool = True) -> torch.dtype:
    """The drafter's product dtype for spec "draft_matmul_dtype" (see SpecConfig); torch.uint8 stands for
    Q4_1 blocks (`kernels.set_q4_1_products`). "auto" on a CPU with an fp32 engine: Q4_1 where the kernels
    multiply it and the drafter's matrices take it (`q4_1_fits`: widths in multiples of 32, rows of 8) — a
    third of bf16's bytes, the proposal's cost, at τ within 1% of bf16's on the shipped drafter
    (docs/benchmarks.md) — else bf16 where bf16 products pay, else the engine dtype."""
    if name == "q4_1":
        return torch.uint8
    if name != "auto":
        return DTYPE_NAMES[name]
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and dtype == torch.float32 and q4_1_fits and has_q4_1_kernels():
        return torch.uint8
    bf16_pays = cpu_has_bf16_dot() or has_bf16w_kernels()  # bf16 dot products, or AVX2's widening kernel
    return torch.bfloat16 if on_cpu and dtype == torch.float32 and bf16_pays else dtype


def per_position(values, num_positions: int, *, fill: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[num_positions]: the given per-position values (temperatures, shifts), `fill` past their end."""
    values = [float(v) for v in list(values if values is not None else [])[:num_positions]]
    out = torch.full((num_positions,), fill, dtype=dtype)
    out[:len(values)] = torch.tensor(values, dtype=dtype)
    return out


def _temperatures(temps: list[float] | None, num_draft_tokens: int) -> torch.Tensor:
    return per_position(temps, num_draft_tokens, fill=1.0)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draft-vocab id from [draft_vocab] probs, on the generator's device (a CPU generator for a
    CUDA drafter keeps seeded requests reproducible)."""
    if generator is not None:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(0)


def build(spec, *, target_config, target_model, dtype, device) -> DSparkDrafter:
    """Registry entry for "dspark" and "dflash" (dflash = heads off)."""
    check(spec, target_config)
    model, temps = load_dspark(spec.model, target_model=target_model, dtype=dtype, device=device,
                               drop_heads=spec.method == "dflash", num_target_layers=target_config.num_hidden_layers,
                               draft_vocab=spec_draft_vocab(spec, target_config))
    temps = temps if spec.method == "dspark" and temps else {}
    # the backbone's products; the heads (and their calibration) stay as loaded, and so does a full-vocabulary
    # LM head (it is the target's own weight, not copied)
    shared_head = model.lm_head if model.cfg.draft_vocab_size is None else None
    skip = (model.markov_head, model.confidence_head, shared_head)
    matmul_dtype = resolve_matmul_dtype(spec.draft_matmul_dtype, dtype=dtype, device=device,
                                        q4_1_fits=q4_1_misfit(model, skip=skip) is None)
    if matmul_dtype != dtype:
        if matmul_dtype == torch.uint8:
            set_q4_1_products(model, skip=skip)
        else:
            set_matmul_dtype(model, matmul_dtype, skip=skip)
        model.pack_layer_products()  # the fused stack reads the copies in place
        release_dense_weights(model)  # an engine's drafter only infers: copies a kernel multiplies stay alone
    if model.markov_head is not None:
        model.markov_head.hold_rows_bf16()  # a bf16 checkpoint's W1 rows: the same values in half the memory
    model.freeze()
    return DSparkDrafter(model, num_draft_tokens=spec.num_speculative_tokens,
                         confidence_temperatures=temps.get("temperatures"),
                         greedy_confidence_temperatures=temps.get("greedy_temperatures"),
                         confidence_biases=temps.get("biases"),
                         greedy_confidence_biases=temps.get("greedy_biases"),
                         draft_topk=spec.draft_topk, context_window=context_window(spec))


def context_window(spec) -> int | None:
    """The positions a draft block reads (`SpecConfig.draft_context_window`): the configured number, or for "auto"
    the sequence length the drafter was trained on (its train_config.json `max_seq_len`); None: the whole context."""
    if spec.draft_context_window != "auto":
        return spec.draft_context_window or None
    file = Path(spec.model) / "train_config.json"
    trained = read_json_object(file).get("max_seq_len") if file.is_file() else None
    return trained if isinstance(trained, int) and not isinstance(trained, bool) and trained > 0 else None
