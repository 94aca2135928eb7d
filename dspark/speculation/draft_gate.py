"""The draft gate: before a step's drafts are proposed, may drafting pay at all under the current load?

`DraftGate` sits in front of the cost-aware policies (prefix, async): before a step's drafts are
proposed it asks whether drafting can pay at all under the current load, from the cost table (draft
seconds included) and a running mean of the survival curve of earlier proposals; when even the best
verify length cannot beat plain decoding it skips the drafter for that step (a probe still drafts every
`probe_every` steps so the estimate follows the traffic). With a free drafter beside the model (prompt lookup) it
also asks whether proposing at all can pay for its own bookkeeping (`proposing_pays`: the recent
lookup-only proposals' survivals at the current load against the measured proposing seconds), and
the engine then skips proposing for the step. The decisions read only past steps, so they keep the output distribution (and
greedy output) unchanged. Above the gate the engine's measured switch (`switch.py`) turns speculation off
at a load where its decode steps, timed whole, do not beat plain decoding's.

Where drafting cannot pay even with the drafter's long-run survival curve, new requests are admitted
without drafter context: that rule is `admission.py` (`AdmissionRule`), which the gate holds and feeds.

    pytest tests/test_draft_gate.py -q
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from dspark.speculation.admission import AdmissionRule
from dspark.speculation.cost_table import CostTable
from dspark.speculation.length_policy import decode_tokens, drafting_gain, ema, masked_survival, throughput_curve

__all__ = ["DraftGate"]


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
    # forward runs faster than the engine's live step (logits rows, sampling, scheduling around it), so a
    # smaller predicted gain is not a gain. With them, the live ratios carry that difference; the margin
    # left covers what the engine's clock cannot see (the API thread's per-token work on the same cores):
    # docs/benchmarks.md, "The draft gate's margin" (benchmarks/results/serving_gate_margin).
    MIN_GAIN = 1.15
    LIVE_MIN_GAIN = 1.10
    # lookup-only proposals whose survivals `proposing_pays` pools (16 × the requests of each)
    FREE_HISTORY = 16
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
        self.admission = AdmissionRule()  # drafter-less admission: fed the same proposals
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

    def admits_model_drafting(self, *, num_reqs: int, cost: CostTable | None) -> bool:
        """May a request joining a load of `num_reqs` requests keep a drafter context? The rule is
        `AdmissionRule.admits`, priced with this gate's fast curve, correction and margins."""
        live = self.live_factor
        return self.admission.admits(num_reqs=num_reqs, cost=cost, fast_survival=self.mean_survival,
                                     correction=self.correction, live_factor=live,
                                     margin=self.min_gain if live is None else self.live_min_gain)

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
        self.time_ratio[mode] = ema(self.time_ratio[mode], ratio, self.time_decay)

    def observe(self, confidence: torch.Tensor, *, num_proposed: Sequence[int] | None = None) -> None:
        """Fold a proposal's confidences [num_reqs, γ] into the mean survival curve."""
        survival = masked_survival(confidence, confidence.shape[1], num_proposed, policy="gate")
        curve = survival.mean(axis=0)  # [γ]
        self._curve_version += 1
        old = self.mean_survival
        self.mean_survival = ema(None if old is None or old.shape != curve.shape else old, curve, self.decay)
        self.admission.observe_curve(curve)

    def expected_gain(self, *, num_reqs: int, num_nondraft_tokens: int, cost: CostTable,
                      num_prompt_tokens: int = 0) -> float:
        """max Θ with drafting ÷ Θ without (drafting pays above `min_gain`)."""
        assert self.mean_survival is not None
        key = (num_reqs, num_nondraft_tokens, num_prompt_tokens, self._curve_version)
        if self._gain_cache is not None and self._gain_cache[0] == key and self._gain_cache[1] is cost:
            return self._gain_cache[2]
        curve = np.clip(self.mean_survival * self.correction, 0.0, 1.0)
        gain = drafting_gain(curve, num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens,
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
        self.propose_seconds_per_req = ema(self.propose_seconds_per_req, seconds / num_reqs, self.time_decay)
        survival = masked_survival(confidence, confidence.shape[1], num_proposed, policy="gate")
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
        self.admission.observe_proposing(pays)
        return pays

    def _free_pays(self, *, num_reqs: int, num_nondraft_tokens: int, num_prompt_tokens: int,
                   cost: CostTable) -> bool:
        pooled = np.sort(np.concatenate([s for s, _ in self._free]))[::-1]  # [num_candidates] descending
        size = round(len(pooled) * num_reqs / sum(n for _, n in self._free))
        if size == 0:  # too few candidates to resample for this load (at low load, where a single
            return True  # lookup hit pays for many proposals): propose
        candidates = pooled[np.linspace(0, len(pooled) - 1, size).round().astype(int)]
        extra = self.propose_seconds_per_req * num_reqs
        best = throughput_curve(candidates, cost=cost, num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens,
                                 num_prompt_tokens=num_prompt_tokens, num_drafted_reqs=0, extra_seconds=extra)
        plain = num_reqs * cost.sps(decode_tokens(num_nondraft_tokens, num_prompt_tokens))
        return bool(best.max() > plain)

    @property
    def correction(self) -> float:
        """Realized ÷ predicted accepted drafts (1 until 16 predicted drafts were verified)."""
        if self._predicted < 16.0:
            return 1.0
        return float(np.clip(self._realized / self._predicted, 0.1, 2.0))

    def observe_verify(self, request_id: str, confidence: list[float] | None, num_drafts: int,
                       num_accepted: int) -> None:
        """A verify observer (engine.spec.verify_observers): compare the drafts the confidences predicted to
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
