"""Engine counters read by the server's /metrics and by benchmarks (vLLM's spec-decode names)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # computed prompt tokens (prefix hits excluded)
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    verify_lens: list[int] = field(default_factory=list)  # recent per-request verify budgets (drained by the server)
    num_wasted_verify_tokens: int = 0  # verified drafts that were rejected
    num_draft_skips: int = 0  # request-steps whose drafting the draft gate skipped (it could not pay)
    num_proposal_skips: int = 0  # steps without any proposal: lookup drafts could not pay for proposing, or measured off
    num_lookup_drafts: int = 0  # request-steps drafted by prompt lookup instead of the model ("ngram_first")
    num_measured_off_steps: int = 0  # steps speculation was off because it measured slower than plain ("measured_switch")
    num_admitted_without_drafter: int = 0  # requests admitted while the draft gate stayed closed ("gate_admission")
    num_draft_faults: int = 0  # request-steps decoded plainly after a drafter fault (engine/faults.py)
    num_failed_requests: int = 0  # requests failed by non-finite target logits (engine/faults.py)
    coalesce_held_steps: list[int] = field(default_factory=list)  # per finished request (drained)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_verify(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_wasted_verify_tokens += num_drafts - num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def record_finished(self, *, coalesce_held_steps: int) -> None:
        with self.lock:
            self.coalesce_held_steps.append(coalesce_held_steps)

    def drain_verify_lens(self) -> list[int]:
        with self.lock:
            out, self.verify_lens = self.verify_lens, []
        return out

    def drain_coalesce_held_steps(self) -> list[int]:
        with self.lock:
            out, self.coalesce_held_steps = self.coalesce_held_steps, []
        return out
