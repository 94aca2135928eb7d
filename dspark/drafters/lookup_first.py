"""Prompt lookup first, the model drafter where lookup cannot do better (`"ngram_first": true`).

Text that repeats its context (code that re-states a signature, an answer that quotes its question)
is drafted almost for free by n-gram prompt lookup (`ngram.py`, ~0.3 ms a step), while a model drafter
costs a forward per step (for the shipped DSpark a sizeable share of a batch-1 decode step). This wrapper
asks the lookup first for every request and runs the model drafter only for the requests where the
lookup found nothing or is expected to keep fewer drafts than the model does.

The lookup asks the request's own context first, then the cross-request cache (`ngram.NgramCache`:
n-grams of finished requests → what followed them; `"lookup_cache_entries"`, 0 turns it off), then the
lookup corpus where one is configured (`corpus.LookupCorpus`, `"lookup_corpus"`); the sources are separate
match classes in the acceptance counts below (own: n, cache: `cache_class` + n, corpus: 2 `cache_class` + n).

"Expected to keep" is measured on the same scale for both: the expected accepted drafts Σ_k Π_{i≤k} c_i
of a proposal. The model's c_k are its calibrated confidences (EMA of the sums over its recent
proposals, per regime); the lookup's come from `LookupAcceptance`, the empirical conditional acceptance
of lookup drafts per (regime, match length, position), counted from verification outcomes. Those
counts are also the lookup rows' confidences, so the cost-aware length policies (prefix, async) and
the draft gate see every row on one calibrated scale, and verify only what pays.

Lossless: a request's draft source, its lookup confidences and the model's running sums depend on
committed tokens and on verification outcomes of earlier steps only, never on the drafts being
verified; lookup drafts are point masses (`draft_probs` None for that row), which rejection sampling
handles as it does for the n-gram method.

Draft gate: a request the gate skips (`ProposeRequest.allow_model` False) still gets a lookup draft when
one matches; it costs nothing to propose and the length policy decides whether to verify it.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.drafters.base import DraftProposal, Drafter, ProposeBatch
from dspark.drafters.corpus import LookupCorpus
from dspark.drafters.ngram import NgramDrafter


class LookupAcceptance:
    """Conditional acceptance c_k of lookup drafts, counted per (greedy?, match class n, position k) (the
    class: the matched length, offset for the cross-request cache, see LookupFirstDrafter):
    c = (accepted + a) / (reached + a + b), a Beta(a, b) prior; counts are halved when a cell reaches
    `max_count` rounds, so the estimate follows the traffic."""

    def __init__(self, *, num_positions: int, max_match: int, prior: tuple[float, float] = (1.0, 1.0),
                 max_count: float = 256.0) -> None:
        shape = (2, max_match + 1, num_positions)  # [greedy?, n, k]
        self.prior = prior
        self.max_count = max_count
        self.accepted = np.zeros(shape)
        self.reached = np.zeros(shape)

    def confidence(self, greedy: bool, match_len: int) -> np.ndarray:  # [num_positions]
        a, b = self.prior
        g = int(greedy)
        return (self.accepted[g, match_len] + a) / (self.reached[g, match_len] + a + b)

    def rounds(self, greedy: bool, match_len: int) -> float:
        """Verified rounds counted for (regime, match length) (halvings included)."""
        return float(self.reached[int(greedy), match_len, 0])

    def expected_accepted(self, greedy: bool, match_len: int, num_drafts: int) -> float:
        return float(np.cumprod(self.confidence(greedy, match_len)[:num_drafts]).sum())

    def observe(self, greedy: bool, match_len: int, num_verified: int, num_accepted: int) -> None:
        """One verified lookup proposal: positions < num_accepted were reached and accepted, position
        num_accepted (when verified) was reached and rejected, later ones were not reached."""
        g = int(greedy)
        num_reached = min(num_accepted + 1, num_verified)
        self.reached[g, match_len, :num_reached] += 1
        self.accepted[g, match_len, :num_accepted] += 1
        full = self.reached[g, match_len] >= self.max_count
        self.reached[g, match_len, full] /= 2
        self.accepted[g, match_len, full] /= 2


class LookupFirstDrafter(Drafter):
    """Wraps a model drafter; attributes it does not define (taps, KV specs, temperatures) are the
    model drafter's."""

    has_free_drafts = True
    MAX_PENDING = 4096  # lookup proposals awaiting their verification outcome

    def __init__(self, model_drafter: Drafter, *, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5,
                 model_decay: float = 0.9, explore_rounds: int = 8, lookup_cache_entries: int = 0,
                 corpus: LookupCorpus | None = None) -> None:
        self.model_drafter = model_drafter
        self.num_draft_tokens = model_drafter.num_draft_tokens
        self.tap_layer_ids = model_drafter.tap_layer_ids
        self.has_confidence = model_drafter.has_confidence
        self.lookup = NgramDrafter(num_draft_tokens=self.num_draft_tokens, prompt_lookup_min=prompt_lookup_min,
                                   prompt_lookup_max=prompt_lookup_max, cache_entries=lookup_cache_entries,
                                   corpus=corpus)
        # match classes: source × cache_class + n (the source: 0 own context, 1 cross-request cache, 2 corpus)
        self.cache_class = max(prompt_lookup_max, 3)
        self.acceptance = LookupAcceptance(num_positions=self.num_draft_tokens, max_match=3 * self.cache_class)
        self.model_decay = model_decay
        self.explore_rounds = explore_rounds
        self.model_expected: dict[bool, float | None] = {False: None, True: None}  # EMA Σ survival, per regime
        self._pending: dict[str, tuple[bool, int]] = {}  # request_id → (greedy?, match class) of lookup drafts

    def __getattr__(self, name: str):  # only reached for names this object does not have
        if name == "model_drafter":
            raise AttributeError(name)
        return getattr(self.model_drafter, name)

    # -- the drafter contract, delegated ---------------------------------------------------------
    def kv_layer_specs(self):
        return self.model_drafter.kv_layer_specs()

    def bind_kv(self, kv_caches) -> None:
        self.model_drafter.bind_kv(kv_caches)

    def bind_target_kv(self, kv_caches, kv_layer_of) -> None:
        self.model_drafter.bind_target_kv(kv_caches, kv_layer_of)

    @property
    def needs_context_kv(self) -> bool:
        return self.model_drafter.needs_context_kv

    def extend_context(self, update):
        return self.model_drafter.extend_context(update)

    def observe_finished(self, all_ids: list[int], num_prompt_tokens: int = 0) -> None:
        self.lookup.observe_finished(all_ids, num_prompt_tokens)

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self.model_drafter.release(request_id)

    # -- proposing -------------------------------------------------------------------------------
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        width = self.num_draft_tokens
        num_reqs = len(batch.requests)
        # filled row by row in numpy (a torch op per row cost more than the lookup), tensors at the end
        draft_ids = np.zeros((num_reqs, width), dtype=np.int64)  # [num_reqs, γ]
        confidence = np.zeros((num_reqs, width), dtype=np.float32)  # [num_reqs, γ]
        num_valid = [0] * num_reqs
        draft_probs: list[torch.Tensor | None] = [None] * num_reqs
        from_model = [False] * num_reqs
        model_rows: list[int] = []
        for i, r in enumerate(batch.requests):
            greedy = r.params.is_greedy
            drafts, n, source = self.lookup.lookup_with_source(r.all_ids)
            match_len = source * self.cache_class + n  # the acceptance class
            self._pending.pop(r.request_id, None)
            if drafts and (not r.allow_model or self._lookup_wins(greedy, match_len, len(drafts))):
                draft_ids[i, :len(drafts)] = drafts
                confidence[i] = self.acceptance.confidence(greedy, match_len)
                num_valid[i] = len(drafts)
                self._pending[r.request_id] = (greedy, match_len)
            elif r.allow_model:
                model_rows.append(i)
        while len(self._pending) > self.MAX_PENDING:  # requests aborted between proposal and verification
            self._pending.pop(next(iter(self._pending)))
        if model_rows:
            sub = ProposeBatch(requests=[batch.requests[i] for i in model_rows],
                               kv_block_size=batch.kv_block_size, draft_sample_method=batch.draft_sample_method)
            proposal = self.model_drafter.propose(sub)
            valid = proposal.num_valid or [proposal.draft_ids.shape[1]] * len(model_rows)
            model_ids = proposal.draft_ids.cpu().numpy()  # [len(model_rows), γ]
            model_conf = None if proposal.confidence is None else proposal.confidence.float().cpu().numpy()
            for j, i in enumerate(model_rows):
                n = min(int(valid[j]), width)
                draft_ids[i, :n] = model_ids[j, :n]
                num_valid[i] = n
                from_model[i] = True
                if proposal.draft_probs is not None:
                    draft_probs[i] = proposal.draft_probs[j]
                if model_conf is not None:
                    confidence[i, :n] = model_conf[j, :n]
            if proposal.confidence is not None:
                self._fold_model(proposal.confidence, valid, [batch.requests[i].params.is_greedy for i in model_rows])
        return DraftProposal(draft_ids=torch.from_numpy(draft_ids),
                             draft_probs=draft_probs if any(p is not None for p in draft_probs) else None,
                             confidence=torch.from_numpy(confidence) if self.has_confidence else None,
                             num_valid=num_valid, from_model=from_model)

    def _lookup_wins(self, greedy: bool, match_len: int, num_drafts: int) -> bool:
        """Lookup drafts are kept when they are expected to keep at least as many drafts as the model's
        recent proposals did; always while the model has no record (or no confidence head) and while
        this (regime, match length) has fewer than `explore_rounds` verified rounds."""
        model = self.model_expected[greedy]
        if model is None or self.acceptance.rounds(greedy, match_len) < self.explore_rounds:
            return True
        return self.acceptance.expected_accepted(greedy, match_len, num_drafts) >= model

    def _fold_model(self, confidence: torch.Tensor, num_valid: list[int], greedy: list[bool]) -> None:
        """EMA of the model's expected accepted drafts Σ_k Π_{i≤k} c_i, per regime."""
        survival = confidence.detach().to("cpu", torch.float64).clamp(0, 1).cumprod(dim=1)  # [rows, γ]
        for row, n, g in zip(survival, num_valid, greedy):
            value = float(row[:n].sum())
            old = self.model_expected[g]
            self.model_expected[g] = value if old is None else self.model_decay * old + (1 - self.model_decay) * value

    # -- verification outcomes (a `SpecController.verify_observers` callback) ------------------------------
    def observe_verify(self, request_id: str, confidence, num_verified: int, num_accepted: int) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None and num_verified > 0:
            self.acceptance.observe(*pending, num_verified=num_verified, num_accepted=num_accepted)
