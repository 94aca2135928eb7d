"""Speculation on or off at a load by the measured cost of a token (spec "measured_switch").

The cost table and the confidence head predict what drafts save; the engine's own clock says what they
did. For each load (the requests of a step, in half-octave buckets: 1, 2, 3-4, 5, 6-8, 9-11, 12-16, ...) and
context (the step's longest request in octaves: under 1k tokens, 1k-2k, 2k-4k, 4k-8k, ...: attention's cost per
verified token grows with the context, and a drafter's acceptance may fall with it) the switch keeps two running
figures from decode-only steps (no prompt chunk): seconds of the whole engine step
per emitted token with speculation on (the engine proposed before the step and proposes after it: its
drafts verified, proposing, choosing, drafter context) and with it off (neither), the first `cold_samples`
of each passed over (a fresh engine's first steps at a load meet new shapes: 2x slower for the drafter).
Until both are known the switch leaves speculation on; then at that load it stays on only while its
seconds per token beat plain decoding's by `min_gain`, a margin for what decode steps do not show (drafts
riding prompt steps, the drafter's context over prompts, requests that finish out of step). The figures
are running sums that weigh the last ~30 samples (`decay`), longer than a stretch of text the drafters
happen to miss: the switch answers for the load (a step-cost curve too steep for drafts to pay for their
bookkeeping), while the confidence-based policies and the draft gate answer for the text, step by step.
Each mode is probed from time to time so both figures stay current: `probe_steps` plain steps every
`plain_every` speculative ones (every `first_plain_every` until plain is known; `wide_plain_every` while
speculation wins by `wide_gain` or more, where a probe costs most and its answer is least in doubt),
`probe_steps` speculative steps every `spec_every` plain ones (the interval doubling up to
`max_spec_every` while probes keep saying "off"). A probe's first step is a transition (it verifies the
other mode's drafts, or proposes without verifying) and is not counted.

Where the step-cost curve is steep (a compute-bound CPU at 8+ requests: a verified draft costs about
what a decoded token does) speculation cannot pay for its own bookkeeping, and the table-based gate
cannot see that bookkeeping; this is the engine's last word on it. The decisions read only past steps'
wall times, never the drafts being verified: the output (greedy or sampled) is unchanged.

    pytest tests/test_switch.py -q
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _LoadState:
    """One load bucket's figures and probe schedule."""

    spec_seconds: float = 0.0  # EMA sums: seconds and emitted tokens of speculative decode steps
    spec_tokens: float = 0.0
    plain_seconds: float = 0.0  # ... of plain decode steps
    plain_tokens: float = 0.0
    num_spec: int = 0  # samples folded in
    num_plain: int = 0
    cold_spec: int = 0  # samples passed over at first (`cold_samples`)
    cold_plain: int = 0
    on: bool = True
    since: int = 0  # steps in the current mode since the last probe
    probe_left: int = 0  # steps of a running probe still to take
    spec_every: int = 0  # the current interval between speculative probes (set when the switch turns off)

    @property
    def spec_per_token(self) -> float | None:
        """Seconds per emitted token of speculative decode steps (None: no sample yet)."""
        return self.spec_seconds / self.spec_tokens if self.num_spec else None

    @property
    def plain_per_token(self) -> float | None:
        return self.plain_seconds / self.plain_tokens if self.num_plain else None


class MeasuredSwitch:
    """Per-load on/off for speculation from measured seconds per emitted token (see the module doc)."""

    def __init__(self, *, min_gain: float = 1.03, min_samples: int = 6, decay: float = 0.97,
                 plain_every: int = 96, first_plain_every: int = 8, wide_plain_every: int = 192,
                 wide_gain: float = 1.2, spec_every: int = 16, max_spec_every: int = 64,
                 probe_steps: int = 3, cold_samples: int = 4) -> None:
        if (min_gain <= 0 or min_samples < 1 or not 0.0 <= decay < 1.0 or probe_steps < 2 or cold_samples < 0
                or min(plain_every, first_plain_every, spec_every) < 1 or max_spec_every < spec_every
                or wide_plain_every < plain_every or wide_gain < min_gain):
            raise ValueError(f"bad MeasuredSwitch settings: min_gain {min_gain}, min_samples {min_samples}, "
                             f"decay {decay}, probe_steps {probe_steps} (>= 2: the first is a transition), "
                             f"intervals {plain_every}/{first_plain_every}/{spec_every}/{max_spec_every}")
        self.min_gain, self.min_samples, self.decay = min_gain, min_samples, decay
        self.plain_every, self.first_plain_every = plain_every, first_plain_every
        self.wide_plain_every, self.wide_gain = wide_plain_every, wide_gain
        self.spec_every, self.max_spec_every, self.probe_steps = spec_every, max_spec_every, probe_steps
        self.cold_samples = cold_samples
        self.loads: dict[tuple[int, int], _LoadState] = {}  # (load bucket, context bucket) -> figures
        # the last two decisions (True: propose): a step is a sample of a mode when both were that mode
        self._decisions: list[bool] = [True, True]
        self._key: tuple[int, int] | None = None  # the buckets of the last decision

    @staticmethod
    def bucket(num_reqs: int) -> int:
        """Half-octave load buckets: 1 → 0, 2 → 2, 3-4 → 4, 5 → 5, 6-8 → 6, 9-11 → 7, 12-16 → 8, ..."""
        return math.ceil(2 * math.log2(max(1, num_reqs)))

    @staticmethod
    def context_bucket(num_tokens: int) -> int:
        """Context octaves: under 1024 tokens → 0, 1024-2047 → 1, 2048-4095 → 2, 4096-8191 → 3, ..."""
        return max(0, int(math.log2(max(1, num_tokens) / 512)))

    @classmethod
    def key(cls, num_reqs: int, context_tokens: int = 0) -> tuple[int, int]:
        return cls.bucket(num_reqs), cls.context_bucket(context_tokens)

    def propose(self, *, num_reqs: int, context_tokens: int = 0) -> bool:
        """Speculate in the next step of a load of `num_reqs` requests whose longest holds `context_tokens`
        (called once per step, before proposing)? Advances the bucket's probe schedule."""
        self._key = self.key(num_reqs, context_tokens)
        s = self.loads.setdefault(self._key, _LoadState())
        if s.probe_left > 0:
            s.probe_left -= 1
            decision = not s.on  # a probe runs the other mode
        else:
            s.since += 1
            interval = self._plain_interval(s) if s.on else s.spec_every
            if s.since >= interval:  # start a probe of the other mode
                s.since, s.probe_left = 0, self.probe_steps - 1
                decision = not s.on
            else:
                decision = s.on
        self._decisions = [self._decisions[1], decision]
        return decision

    def is_off(self, *, num_reqs: int, context_tokens: int = 0) -> bool:
        """Has the switch measured that speculation does not pay at this load and context (admission: no drafter
        context)?"""
        s = self.loads.get(self.key(num_reqs, context_tokens))
        return s is not None and not s.on

    def observe_step(self, *, seconds: float, num_emitted: int, decode_only: bool) -> None:
        """The last step's wall time and emitted tokens (decode_only: no prompt chunk rode it). A sample of
        the mode both of its decisions (the one before it and the one in it) were."""
        prev, cur = self._decisions
        if self._key is None or not decode_only or prev != cur or num_emitted <= 0 or seconds <= 0:
            return
        s = self.loads[self._key]
        if (s.cold_spec if cur else s.cold_plain) < self.cold_samples:  # first calls meet new shapes
            if cur:
                s.cold_spec += 1
            else:
                s.cold_plain += 1
            return
        d = self.decay
        if cur:
            s.spec_seconds, s.spec_tokens = d * s.spec_seconds + seconds, d * s.spec_tokens + num_emitted
            s.num_spec += 1
        else:
            s.plain_seconds, s.plain_tokens = d * s.plain_seconds + seconds, d * s.plain_tokens + num_emitted
            s.num_plain += 1
        self._settle(s)

    def seconds_per_token(self, *, num_reqs: int, context_tokens: int = 0) -> tuple[float | None, float | None]:
        """(speculative, plain) seconds per emitted token measured at this load and context (None: no sample yet)."""
        s = self.loads.get(self.key(num_reqs, context_tokens))
        return (None, None) if s is None else (s.spec_per_token, s.plain_per_token)

    @classmethod
    def bucket_label(cls, bucket: int) -> str:
        """The request counts a bucket holds, e.g. "6-8"."""
        counts = [n for n in range(1, 2 ** (bucket // 2 + 1) + 2) if cls.bucket(n) == bucket]
        return f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"

    @staticmethod
    def context_label(bucket: int) -> str:
        """The context lengths a context bucket holds, e.g. "2k-4k" ("<1k" for bucket 0)."""
        return "<1k" if bucket == 0 else f"{2 ** (bucket - 1)}k-{2 ** bucket}k"

    def snapshot(self) -> list[tuple[str, str, bool, float | None, float | None]]:
        """(load label, context label, on?, speculative and plain seconds per token) per measured bucket, lightest
        first (read by the server's /metrics on another thread: a copy of the table, figures as they stand)."""
        return [(self.bucket_label(load), self.context_label(context), s.on, s.spec_per_token, s.plain_per_token)
                for (load, context), s in sorted(dict(self.loads).items())]

    def _plain_interval(self, s: _LoadState) -> int:
        """Speculative steps between plain probes at a load where speculation is on."""
        if s.num_plain < self.min_samples:
            return self.first_plain_every
        wide = s.num_spec >= self.min_samples and s.spec_per_token * self.wide_gain < s.plain_per_token
        return self.wide_plain_every if wide else self.plain_every

    def _settle(self, s: _LoadState) -> None:
        """Re-decide the load's mode once both figures have `min_samples` samples."""
        if s.num_spec < self.min_samples or s.num_plain < self.min_samples:
            return
        pays = s.spec_per_token * self.min_gain < s.plain_per_token
        if pays and not s.on:
            s.on, s.since, s.probe_left = True, 0, 0
        elif not pays and s.on:
            s.on, s.since, s.probe_left, s.spec_every = False, 0, 0, self.spec_every
        elif not pays and s.probe_left == 0 and s.since == 0:  # a speculative probe that did not convince
            s.spec_every = min(2 * s.spec_every, self.max_spec_every)
