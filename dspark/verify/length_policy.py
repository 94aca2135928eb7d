"""Verify-length policies: how many of each request's drafts the target verifies this step.

A policy sees the drafts' calibrated conditional confidences c_{r,k} (acceptance of draft k given
drafts 1..k-1 were accepted), the step's composition and the step-cost table, and returns
`verify_len` per request — always a prefix of that request's proposal.

* `FixedLength(verify_len)` — the classic γ (capped by what was proposed).
* `ConfidenceThreshold(threshold)` — keep the prefix whose survival a_k = Π_{i≤k} c_i stays
  ≥ threshold (or, with `cumulative=False`, DeepSpec's rule on the conditional c_k).
* `PrefixScheduler` — DSpark Algorithm 1 (reference §6.1): candidates (r, j) ranked by survival
  a_{r,j}; admitted greedily while the expected throughput
      Θ = (num_reqs + Σ admitted a) / (draft_seconds(num_reqs) + step_seconds(nondraft + admitted))
  keeps rising (with no draft curve this is Θ = τ · SPS(B); a prompt chunk riding the step is
  charged to the prompt, not to Θ's output tokens: `_throughput_curve`). The loop BREAKS at the
  first admission that does not raise Θ. The break is what keeps sampling lossless (reference §6.2): c_{k+1} is
  computed from the sampled draft x_k, so a_{r,k+1} depends on x_k. Since a_{r,k+1} ≤ a_{r,k}, and
  ties are broken by position, (r, k+1) is examined only after x_k's admission is final, so
  admitting x_k never depends on x_k. Without the break (`break_on_drop=False`, tests only) a later
  candidate can flip an earlier decision: the Appendix A counterexample, reproduced in
  tests/test_length_policy.py.
* `AsyncPrefixScheduler` — production variant (reference §6.3, §7.4): the *capacity* K (total drafts
  verified this step) is the global argmax of Θ over survivals observed two steps earlier (a causal
  barrier: they cannot depend on this step's drafts), then this step's candidates ranked by current
  survival fill the K slots; no break is needed. The capacity reads only confidences handed to
  `observe()` (a two-entry queue), never the current step's, which `choose()` uses only to rank.

Both cost-aware policies take the step's context from the engine: `num_prompt_tokens` (the prompt
chunks among the non-draft tokens, charged to the prompt), `num_drafted_reqs` (rows the model drafter
ran for; prompt-lookup rows cost no draft seconds) and `max_drafts` (the budget the prompts leave: a
cap on the admitted count, lossless for the same reason as the break — (r, k) ranks above (r, k+1)).

`DraftGate` sits in front of the cost-aware policies (prefix, async): before a step's drafts are
proposed it asks whether drafting can pay at all under the current load, from the cost table (draft
seconds included) and a running mean of the survival curve of earlier proposals; when even the best
verify length cannot beat plain decoding it skips the drafter for that step (a probe still drafts every
`probe_every` steps so the estimate follows the traffic). With a free drafter beside the model (prompt lookup) it
also asks whether proposing at all can pay for its own bookkeeping (`proposing_pays`: the recent
lookup-only proposals' survivals at the current load against the measured proposing seconds), and
the engine then skips proposing for the step. Where the load is such that even the drafter's long-run
survival curve cannot pay, it also tells the scheduler to admit new requests without drafter context
(`admits_model_drafting`; spec "gate_admission"): they cost the model drafter nothing and draft by
prompt lookup only. The decisions read only past steps, so they keep the output distribution (and
greedy output) unchanged. Above the gate the engine's measured switch (`switch.py`) turns speculation off
at a load where its decode steps, timed whole, do not beat plain decoding's.

Policies that need confidences or a cost table fail closed: `build_length_policy(...,
confidence_available=False)` or `choose(confidence=None)` raises a ValueError naming what is
missing.

    pytest tests/test_length_policy.py -q
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch

from dspark.verify.cost_table import CostTable

__all__ = ["LengthPolicy", "FixedLength", "ConfidenceThreshold", "PrefixScheduler",
           "AsyncPrefixScheduler", "DraftGate", "LENGTH_POLICIES", "build_length_policy"]


class LengthPolicy(Protocol):
    needs_confidence: ClassVar[bool]
    needs_cost: ClassVar[bool]

    def choose(
        self,
        *,
        confidence: torch.Tensor | None,  # [num_reqs, >= num_draft_tokens] calibrated c_k
        num_draft_tokens: int,  # γ: drafts proposed per request (the width of the proposal)
        num_nondraft_tokens: int,  # tokens in the step that are not drafts (1 per decoding request
        #                            + prefill chunk tokens)
        cost: CostTable | None = None,  # required by "prefix" and "async"
        num_reqs: int | None = None,  # needed only when confidence is None
        num_proposed: Sequence[int] | None = None,  # [num_reqs] drafts actually proposed (<= γ)
        num_prompt_tokens: int = 0,  # of num_nondraft_tokens, the prompt-chunk tokens (charged to
        #                              the prompt, not to the step's output: `_throughput_curve`)
        num_drafted_reqs: int | None = None,  # requests the drafter ran its forward for (its seconds
        #                                       count in Θ); None: all num_reqs. Prompt-lookup rows are free
        max_drafts: int | None = None,  # prefix / async: at most this many drafts in all (the budget the
        #                                 step's prompt chunks leave); None: no cap
    ) -> list[int]:  # [num_reqs] verify_len per request
        ...


@dataclass(frozen=True)
class FixedLength:
    verify_len: int

    needs_confidence: ClassVar[bool] = False
    needs_cost: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.verify_len < 0:
            raise ValueError(f"verify_len must be >= 0, got {self.verify_len}")

    def choose(self, *, confidence, num_draft_tokens, num_nondraft_tokens, cost=None,
               num_reqs=None, num_proposed=None, num_prompt_tokens=0, num_drafted_reqs=None,
               max_drafts=None) -> list[int]:
        limits = _proposal_limits(confidence, num_draft_tokens, num_reqs, num_proposed)
        return [min(self.verify_len, limit) for limit in limits]


@dataclass(frozen=True)
class ConfidenceThreshold:
    threshold: float
    cumulative: bool = True  # True: survival Π c_i >= threshold; False: each conditional c_k >= it

    needs_confidence: ClassVar[bool] = True
    needs_cost: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")

    def choose(self, *, confidence, num_draft_tokens, num_nondraft_tokens, cost=None,
               num_reqs=None, num_proposed=None, num_prompt_tokens=0, num_drafted_reqs=None,
               max_drafts=None) -> list[int]:
        conditional = _checked_confidence(confidence, num_draft_tokens, policy="threshold")
        scores = np.cumprod(conditional, axis=1) if self.cumulative else conditional
        keep = scores >= self.threshold  # [num_reqs, num_draft_tokens]
        lengths = np.cumprod(keep, axis=1).sum(axis=1).tolist()  # leading run of kept positions
        limits = _proposal_limits(confidence, num_draft_tokens, num_reqs, num_proposed)
        return [min(length, limit) for length, limit in zip(lengths, limits)]


@dataclass(frozen=True)
class PrefixScheduler:
    break_on_drop: bool = True  # False is NOT lossless (Appendix A): for tests and ablations only

    needs_confidence: ClassVar[bool] = True
    needs_cost: ClassVar[bool] = True

    def choose(self, *, confidence, num_draft_tokens, num_nondraft_tokens, cost=None,
               num_reqs=None, num_proposed=None, num_prompt_tokens=0, num_drafted_reqs=None,
               max_drafts=None) -> list[int]:
        survival = _masked_survival(confidence, num_draft_tokens, num_proposed, policy="prefix")
        cost = _require_cost(cost, policy="prefix")
        num_reqs = survival.shape[0]
        ranked_survival, ranked_reqs = _rank_candidates(survival)
        throughput = _throughput_curve(ranked_survival, cost=cost, num_reqs=num_reqs,
                                       num_nondraft_tokens=num_nondraft_tokens,
                                       num_prompt_tokens=num_prompt_tokens, num_drafted_reqs=num_drafted_reqs)
        if self.break_on_drop:
            improves = throughput[1:] > throughput[:-1]  # [num_candidates]
            num_admitted = int(np.cumprod(improves).sum())  # stop at the first non-improvement
        else:
            num_admitted = int(np.argmax(throughput))  # first global maximum
        return _lengths_from_ranking(ranked_reqs[:_capped(num_admitted, max_drafts)], num_reqs)


class AsyncPrefixScheduler:
    """Capacity from confidences observed two `observe()` calls ago; current survivals fill it."""

    needs_confidence: ClassVar[bool] = True
    needs_cost: ClassVar[bool] = True

    def __init__(self, *, cold_start_len: int | None = None) -> None:
        # Until two observations exist: FixedLength(cold_start_len) (None: every proposed draft).
        if cold_start_len is not None and cold_start_len < 0:
            raise ValueError(f"cold_start_len must be >= 0, got {cold_start_len}")
        self.cold_start_len = cold_start_len
        self._history: deque[np.ndarray] = deque(maxlen=2)  # survivals [num_candidates] each

    def observe(
        self,
        confidence: torch.Tensor,  # [num_reqs, num_draft_tokens] a finished step's confidences
        *,
        num_proposed: Sequence[int] | None = None,  # [num_reqs]
    ) -> None:
        """Record a step's confidences; they set the capacity of the step after next."""
        survival = _masked_survival(confidence, confidence.shape[1], num_proposed, policy="async")
        self._history.append(survival[survival > 0])

    def reset(self) -> None:
        self._history.clear()

    def capacity(self, *, cost: CostTable, num_reqs: int, num_nondraft_tokens: int,
                 num_prompt_tokens: int = 0, num_drafted_reqs: int | None = None) -> int | None:
        """K = global argmax of Θ over the stale survivals (no break); None during cold start."""
        if len(self._history) < 2:
            return None
        stale_survival = np.sort(self._history[0])[::-1]
        throughput = _throughput_curve(stale_survival, cost=cost, num_reqs=num_reqs,
                                       num_nondraft_tokens=num_nondraft_tokens,
                                       num_prompt_tokens=num_prompt_tokens, num_drafted_reqs=num_drafted_reqs)
        return int(np.argmax(throughput))

    def choose(self, *, confidence, num_draft_tokens, num_nondraft_tokens, cost=None,
               num_reqs=None, num_proposed=None, num_prompt_tokens=0, num_drafted_reqs=None,
               max_drafts=None) -> list[int]:
        survival = _masked_survival(confidence, num_draft_tokens, num_proposed, policy="async")
        cost = _require_cost(cost, policy="async")
        num_reqs = survival.shape[0]
        capacity = self.capacity(cost=cost, num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens,
                                 num_prompt_tokens=num_prompt_tokens, num_drafted_reqs=num_drafted_reqs)
        if capacity is None:  # cold start: a fixed length per request
            per_request = num_draft_tokens if self.cold_start_len is None else self.cold_start_len
            return FixedLength(per_request).choose(
                confidence=confidence, num_draft_tokens=num_draft_tokens,
                num_nondraft_tokens=num_nondraft_tokens, cost=cost, num_proposed=num_proposed)
        _, ranked_reqs = _rank_candidates(survival)
        return _lengths_from_ranking(ranked_reqs[:_capped(capacity, max_drafts)], num_reqs)


class DraftGate:
    """Skip drafting when the cost table says no verify length can beat plain decoding.

    Expected throughput with drafting: the best Θ over admitting the top candidates of `num_reqs` copies
    of the mean survival curve ā (an exponential moving average over earlier proposals, scaled by the
    realized ÷ predicted accepted drafts of earlier verify windows), with the draft seconds in the
    denominator; without: num_reqs · SPS(num_nondraft_tokens). Draft iff the former is
    higher by the margin, or no curve is known yet, or `probe_every` steps have passed without a draft.

    Live step times (`observe_step`) correct the table: the engine's whole step (scheduling, sampling,
    drafter context, proposal) against the table's prediction for it, as an EMA ratio per mode —
    drafting steps (drafts verified and proposed) and plain steps (neither). Once both ratios are known
    the predicted gain is scaled by plain ÷ drafting ratio and the margin drops from `min_gain` to
    `live_min_gain`. Probes run two steps (the first of a mode change is a transition, not timed): two
    drafting steps for `probe_reqs` of the requests every `probe_every` skipped steps (the interval
    doubles, up to 4x, while probes keep saying "skip"), two plain steps every `plain_probe_every`
    drafting steps (the plain time stays current).
    """

    # Without live step times drafting must promise this much over plain decoding: the profiled verify
    # forward runs 10-20% faster than the engine's live step (logits rows, sampling, scheduling around
    # it), so a predicted gain below ~1.15 is not a gain (measured: humaneval at batch 1, τ 1.38,
    # gain 1.10 -> 0.86x). With them, the live ratios carry that difference; the margin left covers what
    # the engine's clock cannot see (the API thread's per-token work on the same cores): 1.03 left
    # humaneval at batch 1 at 0.82x plain, 1.10 at 0.96x (benchmarks/results/sweep_margin_r3).
    MIN_GAIN = 1.15
    LIVE_MIN_GAIN = 1.10
    # lookup-only proposals whose survivals `proposing_pays` pools (16 × the requests of each)
    FREE_HISTORY = 16
    # admission (`admits_model_drafting`): a request joining a load where drafting could not pay even with the
    # long-run survival curve (an EMA with LONG_DECAY per proposal, trusted from LONG_MIN_PROPOSALS on), or
    # while proposing has been skipped for SKIPPED_PROPOSALS_ADMIT steps in a row (no draft could pay: the
    # model drafter does not run either), gets no drafter context
    LONG_DECAY = 0.98
    LONG_MIN_PROPOSALS = 16
    SKIPPED_PROPOSALS_ADMIT = 16

    def __init__(self, *, probe_every: int = 8, decay: float = 0.7, min_gain: float = MIN_GAIN,
                 live_min_gain: float = LIVE_MIN_GAIN, plain_probe_every: int = 32,
                 time_decay: float = 0.9, probe_reqs: int = 2) -> None:
        if (probe_every < 1 or plain_probe_every < 2 or probe_reqs < 1 or not 0.0 <= decay < 1.0 or not 0.0 <= time_decay < 1.0
                or min_gain <= 0 or live_min_gain <= 0):
            raise ValueError(f"need probe_every >= 1, plain_probe_every >= 2, 0 <= decay, time_decay < 1 and "
                             f"margins > 0, got {probe_every}, {plain_probe_every}, {decay}, {time_decay}, "
                             f"{min_gain}, {live_min_gain}")
        self.probe_every, self.decay, self.min_gain = probe_every, decay, min_gain
        self.live_min_gain, self.plain_probe_every, self.time_decay = live_min_gain, plain_probe_every, time_decay
        self.probe_reqs = probe_reqs
        self.mean_survival: np.ndarray | None = None  # [γ] ā_j
        self.long_survival: np.ndarray | None = None  # [γ] the same, averaged over ~50 proposals
        self._long_count = 0  # proposals folded into long_survival
        self.steps_without_draft = 0
        self.steps_since_plain = 0
        self._probe_run: list[bool] = []  # the decisions left of a running probe
        self._probe_interval = probe_every  # grows while probes keep saying "skip"
        self._probed = False  # the last decision ended a drafting probe
        self._probe_cursor = 0  # drafting probes take `probe_reqs` requests in turn
        # realized ÷ predicted accepted drafts over verified windows (EMA sums): corrects a confidence
        # head that is over- or under-confident on the live traffic
        self._realized, self._predicted = 0.0, 0.0
        # live ÷ table step seconds per mode (EMA), None until observed
        self.time_ratio: dict[str, float | None] = {"draft": None, "plain": None}
        # expected_gain of the last (inputs, curve state): between model proposals the curve does not
        # change, and a closed gate asks the same question every step
        self._curve_version = 0
        self._gain_cache: tuple[tuple, CostTable, float] | None = None
        # proposals without the model drafter (prompt lookup only; `observe_proposal`): the engine's
        # proposing and choosing seconds per request (EMA) and the last few proposals' positive
        # survivals with their request counts
        self.propose_seconds_per_req: float | None = None
        self._free: deque[tuple[np.ndarray, int]] = deque(maxlen=self.FREE_HISTORY)
        self._free_version = 0  # bumped by each observed proposal
        self._pays_cache: tuple[tuple, CostTable, bool] | None = None
        self._steps_without_proposal = 0
        self._proposal_skip_streak = 0  # `proposing_pays` said no this many times in a row (its probes aside)

    def admits_model_drafting(self, *, num_reqs: int, cost: CostTable | None) -> bool:
        """May a request joining a load of `num_reqs` requests keep a drafter context
        (`Request.model_drafting`)? Not where drafting could not pay at that load even with the drafter's
        long-run survival curve (the gate's fast curve follows the last few requests' text; this one, the
        drafter's usual acceptance, so a run of poor drafts at a light load does not count): such a request
        costs no drafter work (no context over its prompt, no taps, no probes) and may take target-only
        prefix-cache hits; its drafts, if any, come from prompt lookup. Requests joining a lighter load
        draft again. Also not while `proposing_pays` has said no `SKIPPED_PROPOSALS_ADMIT` times in a row
        (not even lookup drafts pay at this load, and the engine runs no drafter at all). Until the long-run
        curve has `LONG_MIN_PROPOSALS` proposals the fast curve stands in for it; yes before any proposal,
        and without a cost table. Reads past steps only: lossless."""
        if self._proposal_skip_streak >= self.SKIPPED_PROPOSALS_ADMIT:
            return False
        if cost is None or self.mean_survival is None:
            return True
        # the long-run curve once it has LONG_MIN_PROPOSALS proposals; before that the fast one (a few probes'
        # worth: at a light load nearly any curve pays, at a heavy one a probe's drafts rarely change the answer)
        trusted = self.long_survival is not None and self._long_count >= self.LONG_MIN_PROPOSALS
        live = self.live_factor
        margin = self.min_gain if live is None else self.live_min_gain
        curve = np.clip((self.long_survival if trusted else self.mean_survival) * self.correction, 0.0, 1.0)
        return _gain(curve, num_reqs=num_reqs, num_nondraft_tokens=num_reqs, num_prompt_tokens=0,
                     cost=cost) * (live or 1.0) > margin

    def observe_step(self, *, num_tokens: int, seconds: float, drafts_verified: bool, num_proposed_reqs: int,
                     cost: CostTable | None) -> None:
        """One engine step's wall time. Steps that verified drafts and proposed new ones are drafting
        steps (table: forward of `num_tokens` + draft seconds); steps with neither are plain; the
        transitions between modes are not folded in."""
        if cost is None or num_tokens <= 0 or seconds <= 0:
            return
        if drafts_verified and num_proposed_reqs:
            mode, predicted = "draft", cost.step_seconds(num_tokens) + cost.draft_seconds_for(num_proposed_reqs)
        elif not drafts_verified and not num_proposed_reqs:
            mode, predicted = "plain", cost.step_seconds(num_tokens)
        else:
            return
        ratio = min(max(seconds / predicted, 0.2), 5.0)
        self.time_ratio[mode] = _ema(self.time_ratio[mode], ratio, self.time_decay)

    def observe(self, confidence: torch.Tensor, *, num_proposed: Sequence[int] | None = None) -> None:
        """Fold a proposal's confidences [num_reqs, γ] into the mean survival curve."""
        survival = _masked_survival(confidence, confidence.shape[1], num_proposed, policy="gate")
        curve = survival.mean(axis=0)  # [γ]
        self._curve_version += 1
        old = self.mean_survival
        self.mean_survival = _ema(None if old is None or old.shape != curve.shape else old, curve, self.decay)
        old = self.long_survival
        self.long_survival = _ema(None if old is None or old.shape != curve.shape else old, curve, self.LONG_DECAY)
        self._long_count += 1

    def expected_gain(self, *, num_reqs: int, num_nondraft_tokens: int, cost: CostTable,
                      num_prompt_tokens: int = 0) -> float:
        """max Θ with drafting ÷ Θ without (drafting pays above `min_gain`)."""
        assert self.mean_survival is not None
        key = (num_reqs, num_nondraft_tokens, num_prompt_tokens, self._curve_version)
        if self._gain_cache is not None and self._gain_cache[0] == key and self._gain_cache[1] is cost:
            return self._gain_cache[2]
        curve = np.clip(self.mean_survival * self.correction, 0.0, 1.0)
        gain = _gain(curve, num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens,
                     num_prompt_tokens=num_prompt_tokens, cost=cost)
        self._gain_cache = (key, cost, gain)
        return gain

    def observe_proposal(self, *, seconds: float, confidence: torch.Tensor | None,
                         num_proposed: Sequence[int]) -> None:
        """A step's proposal made without the model drafter (prompt lookup only): the engine's wall time
        for proposing and choosing (an EMA per request) and the drafts' survivals (rows without drafts
        have num_proposed 0), kept for the last `FREE_HISTORY` such proposals."""
        num_reqs = len(num_proposed)
        if num_reqs <= 0 or seconds <= 0 or confidence is None:
            return
        self.propose_seconds_per_req = _ema(self.propose_seconds_per_req, seconds / num_reqs, self.time_decay)
        survival = _masked_survival(confidence, confidence.shape[1], num_proposed, policy="gate")
        self._free.append((survival[survival > 0], num_reqs))
        self._free_version += 1

    def proposing_pays(self, *, num_reqs: int, num_nondraft_tokens: int, cost: CostTable | None,
                       num_prompt_tokens: int = 0) -> bool:
        """Can proposing without the model (prompt lookup) pay for its own bookkeeping at this load?
        Expected throughput with it: the best Θ over the survivals of the last free proposals, pooled
        and resampled (by quantile) to `num_reqs` requests' worth (lookup drafts cost no drafter time;
        the pool keeps their spread — a few requests with sure matches, most with none — which a mean
        curve would average away), with the measured proposing seconds in the denominator; without it:
        plain decoding. Where the step-cost curve is near-linear in the batch (compute-bound: a verified
        token costs almost what a decoded one does) the drafts that pass cannot pay for proposing them,
        and the engine skips proposing altogether; every `probe_every` × 2 steps it proposes anyway, so
        the pool and the timing stay current. Reads only the load, the table and past proposals:
        lossless."""
        if cost is None or self.propose_seconds_per_req is None or not self._free or num_reqs <= 0:
            return True
        self._steps_without_proposal += 1
        if self._steps_without_proposal >= 2 * self.probe_every:
            self._steps_without_proposal = 0
            return True
        key = (num_reqs, num_nondraft_tokens, num_prompt_tokens, self._free_version)
        if self._pays_cache is not None and self._pays_cache[0] == key and self._pays_cache[1] is cost:
            pays = self._pays_cache[2]  # (the answer changes only with the load or a new proposal)
        else:
            pays = self._free_pays(num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens,
                                   num_prompt_tokens=num_prompt_tokens, cost=cost)
            self._pays_cache = (key, cost, pays)
        if pays:
            self._steps_without_proposal = 0
        self._proposal_skip_streak = 0 if pays else self._proposal_skip_streak + 1
        return pays

    def _free_pays(self, *, num_reqs: int, num_nondraft_tokens: int, num_prompt_tokens: int,
                   cost: CostTable) -> bool:
        pooled = np.sort(np.concatenate([s for s, _ in self._free]))[::-1]  # [num_candidates] descending
        size = round(len(pooled) * num_reqs / sum(n for _, n in self._free))
        if size == 0:  # too few candidates to resample for this load (at low load, where a single
            return True  # lookup hit pays for many proposals): propose
        candidates = pooled[np.linspace(0, len(pooled) - 1, size).round().astype(int)]
        extra = self.propose_seconds_per_req * num_reqs
        best = _throughput_curve(candidates, cost=cost, num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens,
                                 num_prompt_tokens=num_prompt_tokens, num_drafted_reqs=0, extra_seconds=extra)
        plain = num_reqs * cost.sps(_decode_tokens(num_nondraft_tokens, num_prompt_tokens))
        return bool(best.max() > plain)

    @property
    def correction(self) -> float:
        """Realized ÷ predicted accepted drafts (1 until 16 predicted drafts were verified)."""
        if self._predicted < 16.0:
            return 1.0
        return float(np.clip(self._realized / self._predicted, 0.1, 2.0))

    def observe_verify(self, request_id: str, confidence: list[float] | None, num_drafts: int,
                       num_accepted: int) -> None:
        """A verify observer (engine.verify_observers): compare the drafts the confidences predicted to
        survive in the verified window with the drafts actually accepted."""
        if not confidence or num_drafts <= 0:
            return
        predicted = float(np.cumprod(np.clip(confidence[:num_drafts], 0.0, 1.0)).sum())
        keep = self.decay ** (1.0 / 8)  # slower than the curve: roughly the last ~25 windows weigh in
        self._realized = keep * self._realized + num_accepted
        self._predicted = keep * self._predicted + predicted
        self._curve_version += 1  # the correction moved

    @property
    def live_factor(self) -> float | None:
        """Plain ÷ drafting live-to-table step-time ratio (None until both modes were timed)."""
        draft, plain = self.time_ratio["draft"], self.time_ratio["plain"]
        return None if draft is None or plain is None else plain / draft

    def should_draft(self, *, num_reqs: int, num_nondraft_tokens: int, cost: CostTable | None,
                     num_prompt_tokens: int = 0) -> bool:
        return bool(self.drafted_requests(num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens, cost=cost,
                                          num_prompt_tokens=num_prompt_tokens))

    def drafted_requests(self, *, num_reqs: int, num_nondraft_tokens: int, cost: CostTable | None,
                         num_prompt_tokens: int = 0, backlog: Sequence[int] | None = None) -> list[int]:
        """Indices of the requests to draft for in this step: all, none, or — a drafting probe while
        skipping — `probe_reqs` of them in turn (a probe only needs confidences and a step time, and
        a full-batch probe at high load costs the very step the gate saved). `backlog`: per request,
        the positions its drafter context still lacks; probes take the requests with the least first
        (a probe then costs no catch-up of a long deferred context), in turn among equals."""
        if cost is None or self.mean_survival is None:
            return list(range(num_reqs))
        probe = False
        if self._probe_run:  # a probe lasts two steps: the second one is a whole step of its mode
            decision = self._probe_run.pop()
            probe = self._probed = decision
        elif self.steps_since_plain + 1 >= self.plain_probe_every and self.time_ratio["draft"] is not None:
            decision, self._probe_run = False, [False]  # keeps the plain step time current
        elif self.steps_without_draft + 1 >= self._probe_interval:
            decision, self._probe_run, probe = True, [True], True
        else:
            live = self.live_factor
            margin = self.min_gain if live is None else self.live_min_gain
            gain = self.expected_gain(num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens, cost=cost,
                                      num_prompt_tokens=num_prompt_tokens)
            decision = gain * (live or 1.0) > margin
            if decision:
                self._probe_interval = self.probe_every
            elif self._probed:  # a probe that did not convince: wait longer before the next one
                self._probe_interval = min(2 * self._probe_interval, 4 * self.probe_every)
            self._probed = False
        if not decision:
            self.steps_without_draft += 1
            self.steps_since_plain = 0
            return []
        self.steps_without_draft = 0
        self.steps_since_plain += 1
        if not probe or num_reqs <= self.probe_reqs:
            return list(range(num_reqs))
        start = self._probe_cursor % num_reqs
        self._probe_cursor += self.probe_reqs
        turn = [(start + i) % num_reqs for i in range(num_reqs)]
        if backlog is not None:
            turn.sort(key=lambda i: backlog[i])  # stable: in turn among equal backlogs
        return sorted(turn[:self.probe_reqs])


LENGTH_POLICIES: dict[str, type] = {
    "fixed": FixedLength,
    "threshold": ConfidenceThreshold,
    "prefix": PrefixScheduler,
    "async": AsyncPrefixScheduler,
}


def build_length_policy(
    name: str,
    *,
    confidence_available: bool = True,  # does the drafter emit confidences?
    cost_available: bool = True,  # is a cost table loaded?
    **kwargs,
) -> LengthPolicy:
    """Construct a policy by name; fails closed if it needs confidences or a cost table that the
    engine does not have."""
    if name not in LENGTH_POLICIES:
        raise ValueError(f"unknown length policy {name!r}; known: {sorted(LENGTH_POLICIES)}")
    cls = LENGTH_POLICIES[name]
    if cls.needs_confidence and not confidence_available:
        raise ValueError(f"length policy {name!r} needs draft confidences, but the drafter "
                         f"provides none (use 'fixed', or a drafter with a confidence head)")
    if cls.needs_cost and not cost_available:
        raise ValueError(f"length policy {name!r} needs a cost table (SPS curve), but none is "
                         f"loaded (run `dspark profile` first)")
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------------
# Helpers


def _checked_confidence(confidence: torch.Tensor | None, num_draft_tokens: int, *,
                        policy: str) -> np.ndarray:  # [num_reqs, num_draft_tokens] float64
    if confidence is None:
        raise ValueError(f"length policy {policy!r} needs draft confidences, got confidence=None")
    if confidence.dim() != 2 or confidence.shape[1] < num_draft_tokens:
        raise ValueError(f"confidence must be [num_reqs, >= {num_draft_tokens}], "
                         f"got {tuple(confidence.shape)}")
    values = confidence[:, :num_draft_tokens].detach().to("cpu", torch.float64).numpy()
    if np.isnan(values).any():
        raise ValueError(f"length policy {policy!r} got NaN confidences")
    return np.clip(values, 0.0, 1.0)


def _masked_survival(confidence: torch.Tensor | None, num_draft_tokens: int,
                     num_proposed: Sequence[int] | None, *,
                     policy: str) -> np.ndarray:  # [num_reqs, num_draft_tokens] float64
    """a_{r,j} = Π_{i≤j} c_{r,i}, zeroed past what request r actually proposed."""
    survival = np.cumprod(_checked_confidence(confidence, num_draft_tokens, policy=policy), axis=1)
    if num_proposed is not None:
        limits = np.asarray(num_proposed).reshape(-1, 1)  # [num_reqs, 1]
        if limits.shape[0] != survival.shape[0]:
            raise ValueError(f"num_proposed has {limits.shape[0]} entries, "
                             f"expected {survival.shape[0]}")
        survival[np.arange(num_draft_tokens).reshape(1, -1) >= limits] = 0.0
    return survival


def _proposal_limits(confidence: torch.Tensor | None, num_draft_tokens: int, num_reqs: int | None,
                     num_proposed: Sequence[int] | None) -> list[int]:
    if num_proposed is not None:
        return [min(int(n), num_draft_tokens) for n in num_proposed]
    if num_reqs is None:
        if confidence is None:
            raise ValueError("need num_reqs (or num_proposed, or confidence) to size the batch")
        num_reqs = confidence.shape[0]
    return [num_draft_tokens] * num_reqs


def _require_cost(cost: CostTable | None, *, policy: str) -> CostTable:
    if cost is None:
        raise ValueError(f"length policy {policy!r} needs a cost table (SPS curve), got cost=None")
    return cost


def _rank_candidates(
    survival: np.ndarray,  # [num_reqs, num_draft_tokens]
) -> tuple[np.ndarray, np.ndarray]:  # ([num_candidates] survival, [num_candidates] req index)
    """Candidates with survival > 0, sorted by survival descending; ties keep position order (j
    before j+1), so every admitted set of leading candidates is a per-request prefix."""
    num_reqs, num_draft_tokens = survival.shape
    by_position = survival.T.reshape(-1)  # [num_draft_tokens * num_reqs], position-major
    req_index = np.tile(np.arange(num_reqs), num_draft_tokens)  # matches by_position
    positive = by_position > 0
    values, reqs = by_position[positive], req_index[positive]
    order = np.argsort(-values, kind="stable")
    return values[order], reqs[order]


def _throughput_curve(
    ranked_survival: np.ndarray,  # [num_candidates] sorted descending
    *,
    cost: CostTable,
    num_reqs: int,
    num_nondraft_tokens: int,
    num_prompt_tokens: int = 0,
    num_drafted_reqs: int | None = None,  # None: the drafter ran for all num_reqs
    extra_seconds: float = 0.0,  # added to every denominator (the proposal's own bookkeeping)
) -> np.ndarray:  # [num_candidates + 1] Θ after admitting the first n candidates, n = 0..
    """Θ(n) = (num_reqs + Σ_{i<n} a_i) / (T(decode) + T(nondraft + n) − T(nondraft) + draft seconds).

    T(B) = 1 / SPS(B); decode = nondraft − prompt tokens (one token per decoding request). Without a
    prompt chunk this is Algorithm 1's Θ. With one, the chunk's own time T(nondraft) − T(decode) is
    the prompt's and leaves the denominator, while the drafts still pay what they add at the step's
    real size. Θ counts output tokens only: keeping the chunk's time in would value a draft against a
    long step (e.g. 16 decoding requests + a 256-token chunk: ~1 s for 16 tokens), so a draft with
    survival 0.06 would seem to pay, when each verified draft costs its full compute (~3 ms here)
    and saves at best a share of a later step. The draft seconds are the drafter's for the requests it
    ran for (`num_drafted_reqs`): prompt-lookup rows cost nothing, and charging a model forward that did
    not run would dilute the verify cost (at 16 lookup rows: 36 ms beside a 60 ms step, so drafts of
    survival 0.5 would pass where 0.75 is the break-even)."""
    expected_tokens = num_reqs + np.concatenate([[0.0], np.cumsum(ranked_survival)])
    batch_tokens = num_nondraft_tokens + np.arange(len(ranked_survival) + 1)
    step_seconds = 1.0 / cost.sps_array(batch_tokens)
    if num_prompt_tokens > 0:
        decode = _decode_tokens(num_nondraft_tokens, num_prompt_tokens)
        step_seconds = step_seconds - step_seconds[0] + cost.step_seconds(decode)
    drafted = num_reqs if num_drafted_reqs is None else num_drafted_reqs
    draft_seconds = cost.draft_seconds_for(drafted) if drafted > 0 else 0.0
    return expected_tokens / (step_seconds + draft_seconds + extra_seconds)


def _gain(curve: np.ndarray, *, num_reqs: int, num_nondraft_tokens: int, num_prompt_tokens: int,
          cost: CostTable) -> float:
    """max Θ over admitting the top candidates of `num_reqs` copies of the survival `curve` [γ], with the draft
    seconds, ÷ Θ of plain decoding."""
    candidates = np.sort(np.tile(curve, num_reqs))[::-1].copy()
    with_drafts = _throughput_curve(candidates, cost=cost, num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens,
                                    num_prompt_tokens=num_prompt_tokens)
    return float(with_drafts.max() / (num_reqs * cost.sps(_decode_tokens(num_nondraft_tokens, num_prompt_tokens))))


def _ema(old, value, decay: float):
    """Exponential moving average: `value` itself when there is no `old` yet."""
    return value if old is None else decay * old + (1.0 - decay) * value


def _capped(num_admitted: int, max_drafts: int | None) -> int:
    """The admitted count under a cap on drafts. Lossless like the break: candidate (r, k) is ranked
    above (r, k + 1) (a_{r,k+1} <= a_{r,k}, ties by position), so its rank, and whether it falls under
    the cap, never depends on the draft x_k its successors' survivals are computed from."""
    return num_admitted if max_drafts is None else min(num_admitted, max(0, max_drafts))


def _decode_tokens(num_nondraft_tokens: int, num_prompt_tokens: int) -> int:
    """Non-draft tokens that are not prompt-chunk tokens (at least 1)."""
    if not 0 <= num_prompt_tokens <= num_nondraft_tokens:
        raise ValueError(f"num_prompt_tokens must be in [0, num_nondraft_tokens={num_nondraft_tokens}], "
                         f"got {num_prompt_tokens}")
    return max(1, num_nondraft_tokens - num_prompt_tokens)


def _lengths_from_ranking(admitted_reqs: np.ndarray, num_reqs: int) -> list[int]:
    return np.bincount(admitted_reqs, minlength=num_reqs).tolist()
