"""Drafter-less admission: does a request joining the running load keep a drafter context
(`Request.model_drafting`; spec key "gate_admission")?

Not where drafting could not pay at that load even with the drafter's long-run survival curve. The draft
gate's fast curve (`draft_gate.py`) follows the last few requests' text; the long-run one here is the
drafter's usual acceptance, so a run of poor drafts at a light load does not count. A request admitted
without context costs no drafter work (no context over its prompt, no taps, no probes) and may take
target-only prefix-cache hits; its drafts, if any, come from prompt lookup. Requests joining a lighter
load draft again. Also not while proposing has been skipped `SKIPPED_PROPOSALS_ADMIT` times in a row
(not even lookup drafts pay at this load, and the engine runs no drafter at all). Until the long-run
curve has `LONG_MIN_PROPOSALS` proposals the fast curve stands in for it; yes before any proposal, and
without a cost table. The rule reads past steps only, so it keeps the output distribution unchanged.

    pytest tests/test_draft_gate.py -q
"""

from __future__ import annotations

import numpy as np

from dspark.speculation.cost_table import CostTable
from dspark.speculation.length_policy import drafting_gain, ema

__all__ = ["AdmissionRule"]


class AdmissionRule:
    """The long-run survival curve and the proposal-skip streak, and the admission decision they give.

    Fed by the draft gate: `observe_curve` with each model proposal's mean survival curve [γ],
    `observe_proposing` with each answer of `DraftGate.proposing_pays` (its probes aside)."""

    # the long-run curve: an EMA with LONG_DECAY per proposal (~50 proposals weigh in), trusted from
    # LONG_MIN_PROPOSALS on; before that the fast curve (a few probes' worth: at a light load nearly any
    # curve pays, at a heavy one a probe's drafts rarely change the answer)
    LONG_DECAY = 0.98
    LONG_MIN_PROPOSALS = 16
    SKIPPED_PROPOSALS_ADMIT = 16

    def __init__(self) -> None:
        self.long_survival: np.ndarray | None = None  # [γ]
        self.num_proposals = 0  # proposals folded into long_survival
        self.proposal_skip_streak = 0  # proposing was found not to pay this many times in a row

    def observe_curve(self, curve: np.ndarray) -> None:  # curve [γ]: one proposal's mean survival
        old = self.long_survival
        self.long_survival = ema(None if old is None or old.shape != curve.shape else old, curve,
                                 self.LONG_DECAY)
        self.num_proposals += 1

    def observe_proposing(self, pays: bool) -> None:
        self.proposal_skip_streak = 0 if pays else self.proposal_skip_streak + 1

    def admits(self, *, num_reqs: int, cost: CostTable | None, fast_survival: np.ndarray | None,
               correction: float, live_factor: float | None, margin: float) -> bool:
        """Yes where the best Θ with drafting, for `num_reqs` copies of the (corrected) curve, beats plain
        decoding's Θ by `margin` (after the live plain ÷ drafting step-time factor, where known)."""
        if self.proposal_skip_streak >= self.SKIPPED_PROPOSALS_ADMIT:
            return False
        if cost is None or fast_survival is None:
            return True
        trusted = self.long_survival is not None and self.num_proposals >= self.LONG_MIN_PROPOSALS
        curve = np.clip((self.long_survival if trusted else fast_survival) * correction, 0.0, 1.0)
        gain = drafting_gain(curve, num_reqs=num_reqs, num_nondraft_tokens=num_reqs, num_prompt_tokens=0,
                             cost=cost)
        return gain * (live_factor or 1.0) > margin
