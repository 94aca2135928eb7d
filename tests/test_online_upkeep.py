"""Online upkeep (dspark/speculation/upkeep.py): moves the cost table and the temperatures toward the truth,
stays bounded, keeps greedy and sampling fits apart, is a no-op when switched off, and keeps greedy parity
in the engine.

    pytest tests/test_online_upkeep.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark.speculation.calibration import OnlineCalibrationConfig
from dspark.speculation.cost_table import CostTable
from dspark.speculation.length_policy import (
    PrefixScheduler,
)
from dspark.speculation.upkeep import OnlineUpkeep, UpkeepConfig
from tests.engine_helpers import greedy
from tests.scheduled_helpers import (  # noqa: F401  (fixtures)
    ARRIVAL_STEPS, GAMMA, MAX_TOKENS, MILD, _mismatches, _prompts, _spec_engine, drafter_dir,
    plain_outputs, run_staged, target)

# -- online upkeep --------------------------------------------------------------------------------
PROFILED = CostTable(num_tokens=[1, 8, 64], steps_per_second=[1000.0, 800.0, 200.0])


def _feed_timings(upkeep: OnlineUpkeep, seconds_of, num_steps: int) -> None:
    for i in range(num_steps):
        b = (1, 8, 64)[i % 3]
        upkeep.observe_step(num_tokens=b, seconds=seconds_of(b))


def test_upkeep_moves_cost_table_toward_truth():
    upkeep = OnlineUpkeep(cost_table=PROFILED, config=UpkeepConfig(refresh_every=12, min_samples=2))
    truth = {b: 2.0 / sps for b, sps in zip(PROFILED.num_tokens, PROFILED.steps_per_second)}
    _feed_timings(upkeep, truth.get, 12 * 12)
    for b, sps in zip(upkeep.cost_table.num_tokens, upkeep.cost_table.steps_per_second):
        assert 1.0 / sps == pytest.approx(truth[b], rel=0.02), b
    assert upkeep.cost_table.meta["online_refreshes"] == 12
    assert upkeep._ratio.numel() == len(PROFILED.num_tokens), "memory is one EMA per profiled point"


def test_upkeep_cost_table_is_bounded():
    cfg = UpkeepConfig(refresh_every=3, min_samples=1, max_step_factor=1.5, max_drift_factor=4.0)
    upkeep = OnlineUpkeep(cost_table=PROFILED, config=cfg)
    previous = PROFILED
    for _ in range(20):  # absurdly slow steps: each refresh moves ≤ 1.5x, the total ≤ 4x
        _feed_timings(upkeep, lambda b: 1000.0, 3)
        for old, new in zip(previous.steps_per_second, upkeep.cost_table.steps_per_second):
            assert old / new <= 1.5 + 1e-9
        previous = upkeep.cost_table
    for base, new in zip(PROFILED.steps_per_second, upkeep.cost_table.steps_per_second):
        assert base / new == pytest.approx(4.0)


class _FakeDrafter:
    has_confidence = True

    def __init__(self, num_positions: int):
        self.confidence_temperatures = torch.ones(num_positions)


def _feed_rounds(upkeep: OnlineUpkeep, drafter: _FakeDrafter, *, true_temperature: float,
                 num_steps: int, rounds_per_step: int = 8, seed: int = 0) -> None:
    """Rounds whose conditional acceptance is σ(z / true_temperature); confidences are emitted
    with the drafter's current temperatures, as the DSpark drafter does."""
    g = torch.Generator().manual_seed(seed)
    gamma = drafter.confidence_temperatures.numel()
    for _ in range(num_steps):
        for r in range(rounds_per_step):
            z = torch.rand(gamma, generator=g, dtype=torch.float64) * 12 - 6  # [γ] raw logits
            conf = torch.sigmoid(z / drafter.confidence_temperatures.double())
            accept = torch.rand(gamma, generator=g, dtype=torch.float64) < torch.sigmoid(
                z / true_temperature)
            num_accepted = int(accept.long().cumprod(0).sum())
            upkeep.observe_verify(f"r{r}", conf.tolist(), gamma, num_accepted)
        upkeep.observe_step(num_tokens=8, seconds=1e-3)


def test_upkeep_moves_temperatures_toward_truth():
    drafter = _FakeDrafter(GAMMA)
    calibration = OnlineCalibrationConfig(refit_every=4, prior_weight=8.0)
    upkeep = OnlineUpkeep(drafter=drafter, config=UpkeepConfig(calibration=calibration))
    _feed_rounds(upkeep, drafter, true_temperature=2.0, num_steps=300)
    temps = drafter.confidence_temperatures.tolist()
    assert temps == pytest.approx(list(upkeep.calibrator.temperatures), rel=1e-6), "not pushed"
    for k, t in enumerate(temps):
        assert abs(math.log(t / 2.0)) < math.log(1.3), f"position {k + 1}: T = {t:.3g}, truth 2"
        assert calibration.min_temperature <= t <= calibration.max_temperature


def test_upkeep_keeps_greedy_and_sampling_fits_apart():
    """A drafter with a separate greedy fit: greedy requests' outcomes move only the greedy
    temperatures, sampling requests' only the sampling ones, each toward its own truth."""
    drafter = _FakeDrafter(GAMMA)
    drafter.greedy_confidence_temperatures = torch.ones(GAMMA)
    calibration = OnlineCalibrationConfig(refit_every=4, prior_weight=8.0)
    greedy_ids = {"r0", "r2", "r4", "r6"}
    upkeep = OnlineUpkeep(drafter=drafter, config=UpkeepConfig(calibration=calibration),
                          is_greedy=lambda rid: rid in greedy_ids)
    assert upkeep.calibrators[True][0] is not upkeep.calibrators[False][0]
    g = torch.Generator().manual_seed(3)
    truth = {True: 0.5, False: 2.0}
    for _ in range(300):
        for r in range(8):
            greedy = f"r{r}" in greedy_ids
            temps = drafter.greedy_confidence_temperatures if greedy else drafter.confidence_temperatures
            z = torch.rand(GAMMA, generator=g, dtype=torch.float64) * 12 - 6
            accept = torch.rand(GAMMA, generator=g, dtype=torch.float64) < torch.sigmoid(z / truth[greedy])
            upkeep.observe_verify(f"r{r}", torch.sigmoid(z / temps.double()).tolist(), GAMMA,
                                  int(accept.long().cumprod(0).sum()))
        upkeep.observe_step(num_tokens=8, seconds=1e-3)
    for greedy, tensor in ((True, drafter.greedy_confidence_temperatures), (False, drafter.confidence_temperatures)):
        for k, t in enumerate(tensor.tolist()):
            assert abs(math.log(t / truth[greedy])) < math.log(1.3), (greedy, k, t)
    # without a separate greedy fit, both regimes feed one calibrator and one tensor
    shared = _FakeDrafter(GAMMA)
    one = OnlineUpkeep(drafter=shared, config=UpkeepConfig(calibration=calibration), is_greedy=lambda rid: True)
    assert one.calibrators[True] is one.calibrators[False]


def test_upkeep_switched_off_changes_nothing():
    drafter = _FakeDrafter(GAMMA)
    upkeep = OnlineUpkeep(drafter=drafter, cost_table=PROFILED,
                          config=UpkeepConfig(enabled=False, refresh_every=1, min_samples=1))
    _feed_rounds(upkeep, drafter, true_temperature=2.0, num_steps=100)
    _feed_timings(upkeep, lambda b: 1.0, 30)
    assert upkeep.cost_table is PROFILED
    assert drafter.confidence_temperatures.tolist() == [1.0] * GAMMA


def test_engine_online_upkeep_wiring(target, drafter_dir, plain_outputs):
    off = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD)
    assert off.spec.upkeep is None, "online_upkeep defaults to off"
    assert off.spec.verify_observers == [] and off.spec.model_verify_observers == [off.spec.draft_gate.observe_verify], \
        "only the draft gate observes"

    engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD, online_upkeep=True)
    assert engine.spec.upkeep is not None and engine.spec.upkeep.observe_verify in engine.spec.model_verify_observers
    # the same wiring with a faster schedule, so a short run refreshes and refits
    engine.spec.model_verify_observers.remove(engine.spec.upkeep.observe_verify)
    fast = UpkeepConfig(refresh_every=8, min_samples=1,
                        calibration=OnlineCalibrationConfig(refit_every=2, min_trials=8.0))
    engine.spec.upkeep = OnlineUpkeep(drafter=engine.drafter, cost_table=engine.cost_table, config=fast)
    engine.spec.model_verify_observers.append(engine.spec.upkeep.observe_verify)
    temps_before = engine.drafter.confidence_temperatures.clone()
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert engine.spec.cost_table is engine.spec.upkeep.cost_table
    assert engine.cost_table.meta.get("online_refreshes", 0) >= 1
    assert engine.cost_table.num_tokens == MILD.num_tokens
    assert not torch.equal(engine.drafter.confidence_temperatures, temps_before), \
        "live verification outcomes must refit the temperatures"

