"""Engine counters (vLLM's spec-decode names) and `EngineStats`, the snapshot of them and of the engine's gauges that
the server's /metrics, /health and stats line read (`Engine.stats()`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


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


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of an engine's counters and gauges (`Engine.stats()`): what /metrics, /health and the stats
    line read, copied so that a reader on another thread sees one consistent set of plain values."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    num_wasted_verify_tokens: int = 0
    num_draft_skips: int = 0
    num_proposal_skips: int = 0
    num_lookup_drafts: int = 0
    num_measured_off_steps: int = 0
    num_admitted_without_drafter: int = 0
    num_draft_faults: int = 0
    num_failed_requests: int = 0
    num_draft_positions: int = 0  # the drafter's drafts per step (K; 0 without a drafter)
    num_prefix_cache_queries: int = 0  # tokens of admitted requests looked up in the prefix cache
    num_prefix_cache_hits: int = 0
    kv_usage: float = 0.0  # 1 = full
    kv_block_size: int = 0
    num_kv_blocks: int = 0
    num_waiting: int = 0
    num_running: int = 0
    # the cost table in use: (num_tokens, steps per second) per profiled point; None without one
    cost_table: tuple[tuple[int, float], ...] | None = None
    # the measured switch's buckets (`MeasuredSwitch.snapshot`); None without the switch
    switch: tuple[tuple[str, str, bool, float | None, float | None], ...] | None = None
    num_state_slots: int = 0  # a hybrid target's recurrent state slots (0: not hybrid)
    num_used_state_slots: int = 0
    num_state_snapshots: int = 0  # a hybrid target's prefix-cache state snapshots (0: none, or prefix caching off)
    num_used_snapshots: int = 0
    num_snapshot_hits: int = 0
    num_snapshots_stored: int = 0
    num_snapshots_evicted: int = 0


COUNTERS = tuple(f.name for f in fields(EngineMetrics) if f.type == "int")  # the snapshot's copied counters


def engine_stats(metrics: EngineMetrics, *, scheduler, block_manager, num_draft_positions: int = 0,
                 cost_table=None, switch=None) -> EngineStats:
    """The snapshot of an engine's parts (plain reads: benign from another thread while the engine steps)."""
    bm = block_manager
    snapshots = bm.num_state_snapshots if bm.num_state_snapshots and bm.enable_prefix_caching else 0
    return EngineStats(
        **{name: getattr(metrics, name) for name in COUNTERS}, accepted_per_pos=tuple(metrics.accepted_per_pos),
        num_draft_positions=num_draft_positions, num_prefix_cache_queries=scheduler.num_prefix_cache_queries,
        num_prefix_cache_hits=scheduler.num_prefix_cache_hits, kv_usage=bm.usage, kv_block_size=bm.kv_block_size,
        num_kv_blocks=len(bm.blocks), num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
        cost_table=None if cost_table is None else tuple(zip(cost_table.num_tokens, cost_table.steps_per_second)),
        switch=None if switch is None else tuple(switch.snapshot()),
        num_state_slots=bm.num_state_slots, num_used_state_slots=bm.num_used_state_slots if bm.num_state_slots else 0,
        num_state_snapshots=snapshots, num_used_snapshots=bm.num_used_snapshots if snapshots else 0,
        num_snapshot_hits=bm.num_snapshot_hits if snapshots else 0,
        num_snapshots_stored=bm.num_snapshots_stored if snapshots else 0,
        num_snapshots_evicted=bm.num_snapshots_evicted if snapshots else 0)
