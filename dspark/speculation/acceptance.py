"""Acceptance statistics of speculative decoding: accepted length τ and per-position rates (reference
§5.3-5.4), pooled over verification rounds, plus a recorder that collects rounds from a live engine.

Definitions (a *round* is one verification of ≥ 1 draft token of one request):

* τ (acceptance length) = Σ (num_accepted + 1) / num_rounds — the recovered/bonus token counted,
  pooled over every round of every request of a dataset (DeepSpec's `accept_len`, the paper's τ).
* conditional acceptance at position k = #rounds with draft k accepted / #rounds where draft k was
  verified and drafts 1..k-1 were all accepted (the paper's Figure 2).
* survival at position k = #rounds with drafts 1..k all accepted / #rounds where draft k was verified
  (DeepSpec's unconditional `accept_rate@k`).

`AcceptCounts.from_rounds` is exact for any verification lengths. `AcceptCounts.from_spec_stats` works
from the engine's per-request `SpecStats` alone, which do not record how many drafts each round
verified; it assumes every round verified the same γ drafts (the fixed-length policy with full
proposals, e.g. DSpark) and says so in `exact`.

`RoundRecorder` attaches to the engine's `spec.verify_observers` and keeps one `RoundRecord` per round, with the
drafter's conditional confidences, for `dspark eval accept` and `dspark calibrate`.

    pytest tests/test_eval_tools.py -q
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["RoundRecord", "AcceptCounts", "RoundRecorder", "summarize"]


@dataclass(frozen=True)
class RoundRecord:
    """One verification round of one request."""

    request_id: str
    num_verified: int  # drafts the target verified (ℓ)
    num_accepted: int  # accepted prefix length, 0..num_verified
    confidence: tuple[float, ...] | None = None  # [num_verified] conditional c_k, None without a head


@dataclass(frozen=True)
class AcceptCounts:
    """Pooled counts; every per-position tuple has one entry per draft position 1..max_positions."""

    num_rounds: int
    num_accepted_tokens: int
    num_verified_tokens: int
    accepted_per_pos: tuple[int, ...]  # [num_positions] rounds with drafts 1..k all accepted
    verified_per_pos: tuple[int, ...]  # [num_positions] rounds where draft k was verified
    trials_per_pos: tuple[int, ...]  # [num_positions] rounds with k verified and 1..k-1 accepted
    exact: bool = True  # False: verified counts assumed (from_spec_stats)

    @classmethod
    def from_rounds(cls, rounds: Iterable[RoundRecord]) -> AcceptCounts:
        rounds = [r for r in rounds if r.num_verified > 0]
        num_positions = max((r.num_verified for r in rounds), default=0)
        accepted, verified, trials = [0] * num_positions, [0] * num_positions, [0] * num_positions
        for r in rounds:
            if not 0 <= r.num_accepted <= r.num_verified:
                raise ValueError(f"round of {r.request_id}: {r.num_accepted} accepted of "
                                 f"{r.num_verified} verified")
            for k in range(r.num_verified):
                verified[k] += 1
                trials[k] += r.num_accepted >= k
                accepted[k] += r.num_accepted > k
        return cls(num_rounds=len(rounds), num_accepted_tokens=sum(r.num_accepted for r in rounds),
                   num_verified_tokens=sum(r.num_verified for r in rounds),
                   accepted_per_pos=tuple(accepted), verified_per_pos=tuple(verified),
                   trials_per_pos=tuple(trials))

    @classmethod
    def from_spec_stats(cls, stats: Iterable, *, num_draft_tokens: int) -> AcceptCounts:
        """Pool `SpecStats` (num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_pos)
        assuming every round verified `num_draft_tokens` (γ) drafts; `exact` is False when the
        recorded draft-token totals show some rounds verified fewer."""
        stats = list(stats)
        num_rounds = sum(s.num_drafts for s in stats)
        accepted = [0] * num_draft_tokens
        for s in stats:
            if len(s.accepted_per_pos) > num_draft_tokens:
                raise ValueError(f"SpecStats has {len(s.accepted_per_pos)} positions, more than "
                                 f"num_draft_tokens={num_draft_tokens}")
            for k, n in enumerate(s.accepted_per_pos):
                accepted[k] += n
        num_verified = sum(s.num_draft_tokens for s in stats)
        return cls(num_rounds=num_rounds, num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
                   num_verified_tokens=num_verified, accepted_per_pos=tuple(accepted),
                   verified_per_pos=(num_rounds,) * num_draft_tokens,
                   trials_per_pos=tuple([num_rounds] + accepted[:-1])[:num_draft_tokens],
                   exact=num_verified == num_rounds * num_draft_tokens)

    def __add__(self, other: AcceptCounts) -> AcceptCounts:
        return AcceptCounts(
            num_rounds=self.num_rounds + other.num_rounds,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            num_verified_tokens=self.num_verified_tokens + other.num_verified_tokens,
            accepted_per_pos=_add(self.accepted_per_pos, other.accepted_per_pos),
            verified_per_pos=_add(self.verified_per_pos, other.verified_per_pos),
            trials_per_pos=_add(self.trials_per_pos, other.trials_per_pos),
            exact=self.exact and other.exact)

    @property
    def acceptance_length(self) -> float:
        """τ: mean tokens emitted per round, the recovered/bonus token counted (1.0 with no rounds)."""
        return 1.0 + self.num_accepted_tokens / self.num_rounds if self.num_rounds else 1.0

    @property
    def conditional_acceptance(self) -> list[float | None]:  # [num_positions]; None: no trials
        return [a / t if t else None for a, t in zip(self.accepted_per_pos, self.trials_per_pos)]

    @property
    def survival(self) -> list[float | None]:  # [num_positions]; None: never verified
        return [a / v if v else None for a, v in zip(self.accepted_per_pos, self.verified_per_pos)]

    @property
    def verify_rate(self) -> float:
        """Σ τ / (Σ verified + num_rounds): the share of verified slots that became output."""
        slots = self.num_verified_tokens + self.num_rounds
        return (self.num_accepted_tokens + self.num_rounds) / slots if slots else 0.0

    def to_dict(self) -> dict:
        return {"acceptance_length": self.acceptance_length, "num_rounds": self.num_rounds,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_verified_tokens": self.num_verified_tokens, "verify_rate": self.verify_rate,
                "conditional_acceptance": self.conditional_acceptance, "survival": self.survival,
                "accepted_per_pos": list(self.accepted_per_pos),
                "verified_per_pos": list(self.verified_per_pos),
                "trials_per_pos": list(self.trials_per_pos), "exact": self.exact}


def summarize(tau_by_dataset: dict[str, float], domain_by_dataset: dict[str, str]) -> dict:
    """Domain means (mean of the dataset τs in each domain) and the macro average over datasets, as
    in the paper's Table 1 discussion (reference §10: 4B DSpark macro 4.727, math 5.57)."""
    domains: dict[str, list[float]] = {}
    for name, tau in tau_by_dataset.items():
        domains.setdefault(domain_by_dataset.get(name, "unknown"), []).append(tau)
    values = list(tau_by_dataset.values())
    return {"domain_means": {d: sum(v) / len(v) for d, v in domains.items()},
            "macro": sum(values) / len(values) if values else None}


@dataclass(eq=False)  # identity equality: detach() must remove this very recorder
class RoundRecorder:
    """Observer for the engine's `spec.verify_observers`: records every round that verified ≥ 1 draft."""

    rounds: list[RoundRecord] = field(default_factory=list)

    def __call__(self, request_id: str, confidence: Sequence[float] | None, num_verified: int,
                 num_accepted: int) -> None:
        if num_verified <= 0:
            return
        conf = None if confidence is None else tuple(float(c) for c in confidence[:num_verified])
        self.rounds.append(RoundRecord(request_id, int(num_verified), int(num_accepted), conf))

    def take(self, request_ids: Iterable[str] | None = None) -> list[RoundRecord]:
        """Remove and return the rounds of `request_ids` (all rounds when None)."""
        if request_ids is None:
            out, self.rounds = self.rounds, []
            return out
        wanted = set(request_ids)
        out = [r for r in self.rounds if r.request_id in wanted]
        self.rounds = [r for r in self.rounds if r.request_id not in wanted]
        return out

    def attach(self, engine) -> RoundRecorder:
        engine.spec.verify_observers.append(self)
        return self

    def detach(self, engine) -> None:
        if self in engine.spec.verify_observers:
            engine.spec.verify_observers.remove(self)


def _add(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))
