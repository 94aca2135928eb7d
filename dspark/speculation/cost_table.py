"""Step-cost table: verification steps per second SPS(B) as a function of the number of tokens B in
the forward, plus (optionally) the drafter's seconds per step as a function of the number of
requests.

Profiled once per (model, hardware, dtype) with `profile()` — which times a caller-supplied
function — then saved next to the model as JSON and looked up by the length policies
(`length_policy.py`).

Lookup rules (`sps`, `step_seconds`, `draft_seconds_for`):
* inside the profiled range: linear interpolation between the two neighbouring points;
* below the smallest profiled size: flat (a smaller batch is never assumed cheaper than measured);
* above the largest: linear in *time*, continuing the slope of the last two points (compute-bound
  growth), never below the last measured time; with a single point, time grows proportionally.

    pytest tests/test_cost_table.py -q
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["CostTable", "profile"]

_FORMAT_VERSION = 1


@dataclass(frozen=True)
class CostTable:
    num_tokens: Sequence[int]  # [num_points] strictly increasing token counts B
    steps_per_second: Sequence[float]  # [num_points] SPS(B) of a target verification forward
    draft_num_reqs: Sequence[int] = ()  # [num_draft_points] strictly increasing request counts
    draft_seconds: Sequence[float] = ()  # [num_draft_points] drafter seconds per step
    meta: dict = field(default_factory=dict)  # free-form provenance: device, model, dtype, date

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tokens", tuple(int(n) for n in self.num_tokens))
        object.__setattr__(self, "steps_per_second", tuple(float(s) for s in self.steps_per_second))
        object.__setattr__(self, "draft_num_reqs", tuple(int(n) for n in self.draft_num_reqs))
        object.__setattr__(self, "draft_seconds", tuple(float(s) for s in self.draft_seconds))
        object.__setattr__(self, "meta", dict(self.meta))
        _check_curve("num_tokens", self.num_tokens, "steps_per_second", self.steps_per_second,
                     allow_empty=False)
        _check_curve("draft_num_reqs", self.draft_num_reqs, "draft_seconds", self.draft_seconds,
                     allow_empty=True)
        if any(s <= 0 for s in self.steps_per_second):
            raise ValueError("steps_per_second must all be > 0")
        if any(s < 0 for s in self.draft_seconds):
            raise ValueError("draft_seconds must all be >= 0")
        object.__setattr__(self, "_sps_memo", {})  # num_tokens -> sps: the engine asks every step
        object.__setattr__(self, "_xs", np.asarray(self.num_tokens, dtype=np.float64))
        object.__setattr__(self, "_ys", np.asarray(self.steps_per_second, dtype=np.float64))
        object.__setattr__(self, "_seconds", np.empty(0))  # [n] step seconds at 0 .. n - 1 tokens (read-only)

    # ------------------------------------------------------------------------------------------
    # Lookups

    def sps(self, num_tokens: int) -> float:
        """Verification steps per second at `num_tokens` tokens (interpolated in SPS inside the
        profiled range; flat below; linear-in-time above)."""
        value = self._sps_memo.get(num_tokens)
        if value is None:
            value = self._sps_memo[num_tokens] = float(self.sps_array(np.asarray([num_tokens]))[0])
        return value

    def sps_array(self, num_tokens: np.ndarray) -> np.ndarray:  # [num_sizes] -> [num_sizes] float
        """Vectorised `sps` (the prefix scheduler evaluates every candidate batch size at once)."""
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        xs, ys = self._xs, self._ys
        inside = np.interp(num_tokens, xs, ys)  # flat outside [xs[0], xs[-1]]
        last_seconds = 1.0 / ys[-1]
        if len(xs) == 1:
            above_seconds = last_seconds * num_tokens / xs[-1]
        else:
            slope = max((last_seconds - 1.0 / ys[-2]) / (xs[-1] - xs[-2]), 0.0)  # seconds per token
            above_seconds = last_seconds + slope * (num_tokens - xs[-1])
        return np.where(num_tokens > xs[-1], 1.0 / np.maximum(above_seconds, 1e-12), inside)

    def step_seconds_range(self, start: int, count: int) -> np.ndarray:  # [count] float64, read-only
        """1 / sps at start, start + 1, .., start + count - 1 tokens: `sps_array`'s values, kept for every
        token count asked so far (the prefix scheduler asks a range of them every step)."""
        end = start + count
        if end > len(self._seconds):
            seconds = 1.0 / self.sps_array(np.arange(max(end, 2 * len(self._seconds))))
            seconds.flags.writeable = False
            object.__setattr__(self, "_seconds", seconds)
        return self._seconds[start:end]

    def step_seconds(self, num_tokens: int) -> float:
        """Seconds of one verification forward over `num_tokens` tokens: 1 / sps(num_tokens)."""
        return 1.0 / self.sps(num_tokens)

    def draft_seconds_for(self, num_reqs: int) -> float:
        """Drafter seconds per step for `num_reqs` requests; 0.0 without a draft curve."""
        if not self.draft_num_reqs:
            return 0.0
        return _interpolate_seconds(self.draft_num_reqs, self.draft_seconds, num_reqs)

    # ------------------------------------------------------------------------------------------
    # Persistence

    def to_dict(self) -> dict:
        return {"format_version": _FORMAT_VERSION, "num_tokens": list(self.num_tokens),
                "steps_per_second": list(self.steps_per_second),
                "draft_num_reqs": list(self.draft_num_reqs),
                "draft_seconds": list(self.draft_seconds), "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict) -> CostTable:
        data = dict(data)
        version = data.pop("format_version", _FORMAT_VERSION)
        if version != _FORMAT_VERSION:
            raise ValueError(f"cost table format_version {version} is not supported "
                             f"(expected {_FORMAT_VERSION})")
        known = {"num_tokens", "steps_per_second", "draft_num_reqs", "draft_seconds", "meta"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown cost table keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_dict(json.loads(Path(path).read_text()))


def profile(
    step_fn: Callable[[int], None],
    *,
    token_counts: Sequence[int],
    repeats: int = 5,
    warmup: int = 2,
    draft_fn: Callable[[int], None] | None = None,
    draft_num_reqs: Sequence[int] = (),
    meta: dict | None = None,
    clock: Callable[[], float] = time.perf_counter,
    settle: int = 3,
) -> CostTable:
    """Time `step_fn(num_tokens)` (one verification forward of that many tokens; it must block until
    the work is done, e.g. synchronise the device) at each token count: `warmup` untimed calls, then
    the median of `repeats` timed calls, taken in rounds over all points, each timed call right after
    `settle` untimed calls of the same point. Optionally time `draft_fn(num_reqs)` the same way, in the
    same rounds."""
    if repeats < 1 or warmup < 0 or settle < 0:
        raise ValueError(f"repeats must be >= 1, warmup and settle >= 0, got {repeats}, {warmup}, {settle}")
    counts = sorted(set(int(n) for n in token_counts))
    if not counts or counts[0] < 1:
        raise ValueError(f"token_counts must be non-empty positive integers, "
                         f"got {list(token_counts)}")
    draft_counts: list[int] = []
    if draft_fn is not None:
        draft_counts = sorted(set(int(n) for n in draft_num_reqs))
        if not draft_counts:
            raise ValueError("draft_fn given without draft_num_reqs")
    points = [(step_fn, n) for n in counts] + [(draft_fn, n) for n in draft_counts]
    medians = _interleaved_medians(points, repeats=repeats, warmup=warmup, clock=clock, settle=settle)
    step_seconds, draft_seconds = medians[:len(counts)], medians[len(counts):]
    # A measured time of 0 (coarse clock) would mean infinite SPS; floor it at 1 ns.
    return CostTable(num_tokens=counts, steps_per_second=[1.0 / max(s, 1e-9) for s in step_seconds],
                     draft_num_reqs=draft_counts, draft_seconds=draft_seconds,
                     meta={"repeats": repeats, "warmup": warmup, "settle": settle, **(meta or {})})


def _interleaved_medians(points: list[tuple[Callable[[int], None], int]], *, repeats: int, warmup: int,
                         clock: Callable[[], float], settle: int) -> list[float]:
    """Median seconds of each fn(n): `warmup` untimed calls per point, then `repeats` rounds that time
    every point once. Rounds, not one point after another, so a machine that slows down for a while
    (shared VMs do, by 20-40% for seconds at a time) slows every point alike instead of a few. Each
    timed call follows `settle` untimed calls of its own point: a step right after a much larger one (a
    128-token step, a 64-request proposal) inherits its cold caches for two or three steps, which makes a
    1-token step slower than in decoding and a verified token's marginal cost look a fraction of what it
    is (docs/benchmarks.md, "The step-cost table")."""
    for fn, n in points:
        for _ in range(warmup):
            fn(n)
    samples: list[list[float]] = [[] for _ in points]
    for _ in range(repeats):
        for (fn, n), times in zip(points, samples):
            for _ in range(settle):
                fn(n)
            start = clock()
            fn(n)
            times.append(clock() - start)
    return [statistics.median(times) for times in samples]


def _interpolate_seconds(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) seconds; flat below xs[0]; above xs[-1], continue the last
    segment's slope (floored at 0), or proportionally to x when there is a single point."""
    if x > xs[-1]:
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return ys[-1] + slope * (x - xs[-1])
    return float(np.interp(x, xs, ys))


def _check_curve(x_name: str, xs: Sequence, y_name: str, ys: Sequence, *,
                 allow_empty: bool) -> None:
    if len(xs) != len(ys):
        raise ValueError(f"{x_name} and {y_name} must have equal lengths, "
                         f"got {len(xs)} and {len(ys)}")
    if not xs and not allow_empty:
        raise ValueError(f"{x_name} must not be empty")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError(f"{x_name} must be strictly increasing, got {list(xs)}")
    if xs and xs[0] < 1:
        raise ValueError(f"{x_name} must be >= 1, got {list(xs)}")
