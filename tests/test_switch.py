"""The measured switch (dspark/speculation/switch.py): speculation on or off per load by the engine's own seconds
per emitted token, driven here by scripted step times (no clock, so every outcome is exact):

* speculation that measures slower than plain decoding (or within the margin) is switched off once both
  modes have their samples; faster speculation stays on; loads are decided apart;
* the probe schedule: plain probes while on (rarer where speculation wins widely), speculative probes while
  off with a doubling interval; the first step of each probe (a transition) is never counted, nor are steps
  with a prompt chunk;
* in the engine: a load measured "off" proposes nothing and admits requests without drafter context, and
  the output still equals plain decoding.

    pytest tests/test_switch.py -q
"""

from __future__ import annotations

import pytest

from dspark.speculation.switch import MeasuredSwitch


def warm(**settings) -> MeasuredSwitch:
    """A switch that folds every sample from the first (cold_samples=0; the default's pass-over is tested
    on its own)."""
    return MeasuredSwitch(**{"cold_samples": 0, **settings})


def drive(switch: MeasuredSwitch, *, num_reqs: int, steps: int, spec_ms_per_token: float,
          plain_ms_per_token: float, decode_only: bool = True, context_tokens: int = 0) -> list[bool]:
    """Run `steps` engine steps: each asks the switch, then reports a step whose cost per emitted token is
    that of the mode the step ran in (the previous decision: drafts proposed then are verified now)."""
    decisions, previous = [], True
    for _ in range(steps):
        decision = switch.propose(num_reqs=num_reqs, context_tokens=context_tokens)
        ms = spec_ms_per_token if previous else plain_ms_per_token
        switch.observe_step(seconds=ms * num_reqs / 1000, num_emitted=num_reqs, decode_only=decode_only)
        decisions.append(decision)
        previous = decision
    return decisions


def test_buckets_are_half_octaves():
    assert [MeasuredSwitch.bucket(n) for n in (1, 2, 3, 4, 5, 6, 8, 9, 11, 12, 16, 17)] == \
        [0, 2, 4, 4, 5, 6, 6, 7, 7, 8, 8, 9]


@pytest.mark.parametrize("spec_ms, expect_on", [(1.10, False), (1.00, False), (0.98, False), (0.90, True)])
def test_speculation_stays_on_only_where_it_measures_faster_by_the_margin(spec_ms, expect_on):
    """Plain decoding at 1.0 ms a token; the margin is 3%: 0.98 is not enough."""
    switch = warm(min_gain=1.03)
    drive(switch, num_reqs=8, steps=200, spec_ms_per_token=spec_ms, plain_ms_per_token=1.0)
    assert switch.is_off(num_reqs=8) is not expect_on
    spec, plain = switch.seconds_per_token(num_reqs=8)
    assert spec == pytest.approx(spec_ms / 1000) and plain == pytest.approx(1.0 / 1000)


def test_context_octaves_are_decided_apart():
    """A long context where speculation measures slower (its drafts miss, attention prices each verified token
    higher) is switched off there only; short contexts at the same load keep speculating."""
    assert [MeasuredSwitch.context_bucket(n) for n in (0, 600, 1023, 1024, 2047, 2048, 4096, 8000, 8192)] == \
        [0, 0, 0, 1, 1, 2, 3, 3, 4]
    assert [MeasuredSwitch.context_label(b) for b in (0, 1, 3)] == ["<1k", "1k-2k", "4k-8k"]
    switch = warm()
    drive(switch, num_reqs=1, steps=200, spec_ms_per_token=0.7, plain_ms_per_token=1.0, context_tokens=300)
    drive(switch, num_reqs=1, steps=200, spec_ms_per_token=1.3, plain_ms_per_token=1.2, context_tokens=7000)
    assert not switch.is_off(num_reqs=1, context_tokens=300) and not switch.is_off(num_reqs=1)
    assert switch.is_off(num_reqs=1, context_tokens=7000) and switch.is_off(num_reqs=1, context_tokens=4096)
    assert not switch.is_off(num_reqs=1, context_tokens=9000)  # never measured: on
    assert [(load, context, on) for load, context, on, _, _ in switch.snapshot()] == \
        [("1", "<1k", True), ("1", "4k-8k", False)]


def test_loads_are_decided_apart():
    switch = warm()
    drive(switch, num_reqs=8, steps=200, spec_ms_per_token=1.2, plain_ms_per_token=1.0)  # heavy: off
    drive(switch, num_reqs=1, steps=200, spec_ms_per_token=0.7, plain_ms_per_token=1.0)  # light: on
    assert switch.is_off(num_reqs=8) and switch.is_off(num_reqs=7) and not switch.is_off(num_reqs=1)
    assert not switch.is_off(num_reqs=32)  # never measured: on
    # back at the heavy load it is still off, probing now and then
    decisions = drive(switch, num_reqs=8, steps=300, spec_ms_per_token=1.2, plain_ms_per_token=1.0)
    assert 0 < sum(decisions) < 30


def test_unmeasured_loads_speculate_and_probe_plain_early():
    """Until plain decoding has min_samples samples the switch stays on, with a plain probe of probe_steps
    every first_plain_every steps; each probe counts probe_steps - 1 samples (its first step is the
    transition from drafts proposed before it)."""
    switch = warm(first_plain_every=8, probe_steps=3, min_samples=4)
    decisions = drive(switch, num_reqs=4, steps=30, spec_ms_per_token=0.5, plain_ms_per_token=1.0)
    off = [i for i, d in enumerate(decisions) if not d]
    assert off == [7, 8, 9, 17, 18, 19, 27, 28, 29][:len(off)] and len(off) >= 6
    state = switch.loads[MeasuredSwitch.key(4)]
    assert state.num_plain >= 4 and state.on
    # after that, plain probes every wide_plain_every speculative steps while speculation wins by wide_gain
    # (here 2x) ...
    decisions = drive(switch, num_reqs=4, steps=2 * switch.wide_plain_every + 10, spec_ms_per_token=0.5,
                      plain_ms_per_token=1.0)
    assert decisions.count(False) == 2 * switch.probe_steps
    # ... and every plain_every where its lead is narrower
    narrow = warm()
    drive(narrow, num_reqs=4, steps=100, spec_ms_per_token=0.9, plain_ms_per_token=1.0)
    decisions = drive(narrow, num_reqs=4, steps=4 * narrow.plain_every, spec_ms_per_token=0.9,
                      plain_ms_per_token=1.0)
    assert not narrow.is_off(num_reqs=4) and decisions.count(False) in (3 * narrow.probe_steps, 4 * narrow.probe_steps)


def test_transitions_and_prompt_steps_are_not_samples():
    switch = warm()
    switch.propose(num_reqs=2)
    switch.observe_step(seconds=1.0, num_emitted=2, decode_only=False)  # a prompt chunk rode the step
    assert switch.loads[MeasuredSwitch.key(2)].num_spec == 0
    switch.observe_step(seconds=1.0, num_emitted=2, decode_only=True)
    assert switch.loads[MeasuredSwitch.key(2)].num_spec == 1
    # a spec → plain transition: the step that verifies the last drafts but proposes none
    s = switch.loads[MeasuredSwitch.key(2)]
    s.since = switch.first_plain_every  # the next decision starts a plain probe
    assert switch.propose(num_reqs=2) is False
    switch.observe_step(seconds=5.0, num_emitted=2, decode_only=True)
    assert s.num_plain == 0 and s.num_spec == 1
    assert switch.propose(num_reqs=2) is False
    switch.observe_step(seconds=1.0, num_emitted=2, decode_only=True)
    assert s.num_plain == 1


def test_speculative_probes_back_off_while_they_keep_saying_off():
    switch = warm(spec_every=16, max_spec_every=64, decay=0.85)
    decisions = drive(switch, num_reqs=8, steps=460, spec_ms_per_token=1.5, plain_ms_per_token=1.0)
    state = switch.loads[MeasuredSwitch.key(8)]
    assert not state.on
    starts = [i for i in range(1, len(decisions)) if decisions[i] and not decisions[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]  # a probe's steps + the interval before the next
    assert gaps == sorted(gaps) and gaps[0] < gaps[-1] == 64 + switch.probe_steps - 1, gaps
    # the traffic changes: speculation now pays, a probe sees it and the load turns back on
    drive(switch, num_reqs=8, steps=400, spec_ms_per_token=0.5, plain_ms_per_token=1.0)
    assert state.on


def test_a_short_stretch_of_poor_drafts_does_not_switch_a_load_that_pays_off():
    """The figures average ~30 samples: a few steps of text the drafters miss (the length policies' business)
    do not turn speculation off where it pays on the whole (the switch answers for the load)."""
    switch = warm()
    drive(switch, num_reqs=1, steps=300, spec_ms_per_token=0.75, plain_ms_per_token=1.0)
    drive(switch, num_reqs=1, steps=8, spec_ms_per_token=1.2, plain_ms_per_token=1.0)
    assert not switch.is_off(num_reqs=1)
    drive(switch, num_reqs=1, steps=120, spec_ms_per_token=1.2, plain_ms_per_token=1.0)
    assert switch.is_off(num_reqs=1), "a lasting change does"


def test_snapshot_labels_each_load_by_its_request_counts():
    assert [MeasuredSwitch.bucket_label(b) for b in (0, 2, 4, 5, 6, 7, 8)] == \
        ["1", "2", "3-4", "5", "6-8", "9-11", "12-16"]
    switch = warm()
    drive(switch, num_reqs=8, steps=200, spec_ms_per_token=1.2, plain_ms_per_token=1.0)
    drive(switch, num_reqs=1, steps=6, spec_ms_per_token=0.5, plain_ms_per_token=1.0)  # (no plain probe yet)
    (light, _, light_on, light_spec, light_plain), (heavy, _, heavy_on, spec, plain) = switch.snapshot()
    assert (light, light_on, light_plain) == ("1", True, None) and light_spec == pytest.approx(0.5e-3)
    assert (heavy, heavy_on) == ("6-8", False)
    assert spec == pytest.approx(1.2e-3) and plain == pytest.approx(1.0e-3)


def test_the_first_samples_of_each_mode_are_passed_over():
    """A fresh engine's first steps at a load meet new shapes (the drafter's products at new row counts);
    the first cold_samples samples of each mode are not folded in."""
    switch = MeasuredSwitch(cold_samples=3, first_plain_every=4)
    decisions = drive(switch, num_reqs=2, steps=30, spec_ms_per_token=0.5, plain_ms_per_token=1.0)
    state = switch.loads[MeasuredSwitch.key(2)]
    assert state.cold_spec == state.cold_plain == 3
    pairs = list(zip([True] + decisions, decisions))  # (decision before a step, decision in it)
    assert state.num_spec == pairs.count((True, True)) - 3 and state.num_plain == pairs.count((False, False)) - 3


def test_settings_are_checked():
    with pytest.raises(ValueError, match="probe_steps"):
        warm(probe_steps=1)
    with pytest.raises(ValueError, match="MeasuredSwitch"):
        warm(spec_every=32, max_spec_every=16)


def test_metrics_expose_each_load_decision_and_figures():
    from dspark.engine.metrics import EngineStats
    from dspark.server.metrics import ServerStats, _EngineCollector

    switch = warm()
    drive(switch, num_reqs=8, steps=200, spec_ms_per_token=1.2, plain_ms_per_token=1.0)
    families = {f.name: f for f in _EngineCollector(
        lambda: ServerStats(engine=EngineStats(switch=tuple(switch.snapshot())))).collect()}
    on = {s.labels["load"]: s.value for s in families["vllm:measured_switch_on"].samples}
    per_token = {(s.labels["load"], s.labels["mode"]): s.value
                 for s in families["vllm:measured_switch_seconds_per_token"].samples}
    assert on == {"6-8": 0.0}
    assert per_token == pytest.approx({("6-8", "speculative"): 1.2e-3, ("6-8", "plain"): 1.0e-3})
    assert "vllm:measured_switch_on" not in {
        f.name for f in _EngineCollector(lambda: ServerStats(engine=EngineStats())).collect()}
