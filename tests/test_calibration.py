"""Tests for dspark/speculation/calibration.py: ECE / AUROC on hand-computed cases, STS on synthetic
miscalibrated confidences (lowers ECE, keeps AUROC), save/load, the reliability PNG, and the online
calibrator's convergence, shrinkage, cold start and off switch.

    pytest tests/test_calibration.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark.speculation.calibration import (
    STS_BIAS_GRID,
    STS_GRID,
    OnlineCalibrationConfig,
    OnlineCalibrator,
    STSCalibration,
    auroc,
    calibration_report,
    expected_calibration_error,
    fit_sts,
    plot_reliability,
    survival,
    survival_labels,
)

TRUE_TEMPERATURES = (2.5, 0.5, 2.0, 1.0)  # the drafter is over-, under-, over-, well-confident


def _synthetic_rounds(generator: torch.Generator, num_rounds: int,
                      temperatures=TRUE_TEMPERATURES) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits z ~ N(1.5, 2.5²); draft k accepted (given earlier ones were) w.p. σ(z_k / T_k)."""
    num_positions = len(temperatures)
    logits = 1.5 + 2.5 * torch.randn(num_rounds, num_positions, generator=generator,
                                      dtype=torch.float64)
    conditional = torch.sigmoid(logits / torch.tensor(temperatures, dtype=torch.float64))
    accepted = torch.rand(num_rounds, num_positions, generator=generator,
                          dtype=torch.float64) < conditional
    return logits, accepted.long().cumprod(dim=1).sum(dim=1)  # [num_rounds, γ], [num_rounds]


# --------------------------------------------------------------------------------------------------
# Hand-computed metrics


def test_survival_and_labels():
    assert torch.allclose(survival(torch.tensor([[0.5, 0.5, 1.0]])),
                          torch.tensor([[0.5, 0.25, 0.25]]))
    labels = survival_labels(torch.tensor([0, 2, 3]), 3)
    assert labels.tolist() == [[False, False, False], [True, True, False], [True, True, True]]


def test_ece_hand_computed():
    # 20 bins: 0.10 and 0.12 share bin 2 (mean p 0.11, mean y 0.5) -> 2/4 · 0.39 = 0.195;
    # 0.80 in bin 16 -> 1/4 · 0.2 = 0.05; 0.95 in bin 19 -> 1/4 · 0.05 = 0.0125. Total 0.2575.
    ece = expected_calibration_error(torch.tensor([0.10, 0.12, 0.80, 0.95]),
                                     torch.tensor([0, 1, 1, 1]))
    assert ece == pytest.approx(0.2575)
    # p = 1.0 goes to the last bin; a perfectly calibrated bin contributes 0.
    assert expected_calibration_error(torch.tensor([1.0, 0.5, 0.5]), torch.tensor([1, 0, 1])) == 0.0
    # 2 bins: [0.2, 0.4] -> mean .3 vs .5; [0.6, 0.9] -> mean .75 vs 0.5 -> (.2 + .25)/2
    ece = expected_calibration_error(torch.tensor([0.2, 0.4, 0.6, 0.9]), torch.tensor([0, 1, 1, 0]),
                                     num_bins=2)
    assert ece == pytest.approx(0.225)


def test_auroc_hand_computed():
    # Pairs (pos, neg): (0.35, 0.1) ok, (0.35, 0.4) wrong, (0.8, *) ok -> 3/4
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5  # ties: half credit
    assert auroc(torch.tensor([0.2, 0.5, 0.5, 0.9]), torch.tensor([0, 1, 0, 1])) == 0.875
    assert auroc(torch.tensor([0.9, 0.1]), torch.tensor([0, 1])) == 0.0
    assert math.isnan(auroc(torch.tensor([0.3, 0.4]), torch.tensor([1, 1])))


def test_auroc_matches_pairwise_definition():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 10, (300,), generator=generator).double()  # many ties
    labels = torch.rand(300, generator=generator) < 0.4
    pos, neg = scores[labels].view(-1, 1), scores[~labels].view(1, -1)
    pairwise = float(((pos > neg).double() + 0.5 * (pos == neg).double()).mean())
    assert auroc(scores, labels) == pytest.approx(pairwise, abs=1e-12)


# --------------------------------------------------------------------------------------------------
# Offline STS


def test_sts_lowers_ece_and_keeps_auroc():
    generator = torch.Generator().manual_seed(1)
    train_logits, train_accepted = _synthetic_rounds(generator, 20_000)
    test_logits, test_accepted = _synthetic_rounds(generator, 20_000)
    calibration = fit_sts(logits=train_logits, num_accepted=train_accepted)
    for fitted, true in zip(calibration.temperatures, TRUE_TEMPERATURES):
        assert abs(math.log(fitted / true)) < math.log(1.25), calibration.temperatures
    raw = calibration_report(logits=test_logits, num_accepted=test_accepted)
    fitted = calibration_report(logits=test_logits, num_accepted=test_accepted,
                                calibration=calibration)
    for before, after in zip(raw, fitted):
        # Raw ECEs are 4-13 %; 20k held-out rounds put the calibrated ECE near 1 %.
        assert after["ece"] < 0.02 and after["ece"] < before["ece"] / 2, (before, after)
        # σ(z/T) is monotone, so position 1's AUROC is identical; later positions rank a product of
        # rescaled terms and may move, but must not get worse.
        if before["position"] == 1:
            assert after["auroc"] == pytest.approx(before["auroc"], abs=1e-12)
        assert after["auroc"] > before["auroc"] - 0.005, (before, after)


def test_shifted_sts_removes_a_bias_that_temperatures_cannot():
    """A head too confident by a constant (acceptance σ(z − 2)): temperatures alone leave a large ECE at
    position 1; the searched shift finds b ≈ −2, brings every position under 2 % and keeps AUROC."""
    generator = torch.Generator().manual_seed(4)

    def rounds(n):
        logits = 1.5 + 2.5 * torch.randn(n, 4, generator=generator, dtype=torch.float64)
        accepted = torch.rand(n, 4, generator=generator, dtype=torch.float64) < torch.sigmoid(logits - 2.0)
        return logits, accepted.long().cumprod(dim=1).sum(dim=1)

    (train, train_acc), (test, test_acc) = rounds(20_000), rounds(20_000)
    plain = fit_sts(logits=train, num_accepted=train_acc)
    shifted = fit_sts(logits=train, num_accepted=train_acc, bias_grid=STS_BIAS_GRID[::4])  # 0.4 apart
    assert plain.biases is None and abs(shifted.biases[0] + 2.0) < 0.3, shifted
    raw = calibration_report(logits=test, num_accepted=test_acc)
    only_t = calibration_report(logits=test, num_accepted=test_acc, calibration=plain)
    both = calibration_report(logits=test, num_accepted=test_acc, calibration=shifted)
    assert only_t[0]["ece"] > 0.03, only_t[0]  # a scale cannot remove a shift
    for before, after in zip(raw, both):
        assert after["ece"] < 0.02 and after["ece"] < before["ece"] / 2, (before, after)
        assert after["auroc"] > before["auroc"] - 0.005, (before, after)
    assert both[0]["auroc"] == pytest.approx(raw[0]["auroc"], abs=1e-12)


def test_sts_respects_num_verified_and_unverified_positions():
    generator = torch.Generator().manual_seed(2)
    logits, num_accepted = _synthetic_rounds(generator, 10_000)
    # Only positions 1-2 verified; labels beyond them would be garbage and must not be used.
    num_verified = torch.full_like(num_accepted, 2)
    calibration = fit_sts(logits=logits, num_accepted=num_accepted.clamp_max(2),
                          num_verified=num_verified)
    assert calibration.temperatures[2:] == (1.0, 1.0)  # no data: stays at 1
    assert abs(math.log(calibration.temperatures[0] / TRUE_TEMPERATURES[0])) < math.log(1.25)


def test_sts_apply_save_load(tmp_path):
    calibration = STSCalibration(temperatures=(2.0, 0.5))
    logits = torch.tensor([[2.0, -1.0]])
    assert torch.allclose(calibration.apply(logits), torch.sigmoid(torch.tensor([[1.0, -2.0]])))
    path = tmp_path / "sts_calibration.json"
    calibration.save(path)
    assert STSCalibration.load(path) == calibration
    with pytest.raises(ValueError, match="positions"):
        calibration.apply(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="positive"):
        STSCalibration(temperatures=(1.0, 0.0))
    shifted = STSCalibration(temperatures=(2.0, 0.5), biases=(-1.0, 0.5))
    assert torch.allclose(shifted.apply(logits), torch.sigmoid(torch.tensor([[0.0, -1.5]])))
    shifted.save(path)
    assert STSCalibration.load(path) == shifted
    with pytest.raises(ValueError, match="biases"):
        STSCalibration(temperatures=(1.0, 1.0), biases=(0.0,))
    path.write_text('{"temperatures": [1.0]}')
    with pytest.raises(ValueError, match="not an STS calibration file"):
        STSCalibration.load(path)
    assert 1.0 in STS_GRID


def test_reliability_png(tmp_path):
    generator = torch.Generator().manual_seed(3)
    logits, num_accepted = _synthetic_rounds(generator, 2_000)
    labels = survival_labels(num_accepted, 4).double()
    path = tmp_path / "reliability.png"
    plot_reliability(curves={"raw pos 1": (torch.sigmoid(logits[:, 0]), labels[:, 0]),
                             "raw pos 3": (survival(torch.sigmoid(logits))[:, 2], labels[:, 2])},
                     path=path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------------
# Online calibrator


def _feed(calibrator: OnlineCalibrator, generator: torch.Generator, *, num_updates: int,
          num_reqs: int = 64, temperatures=TRUE_TEMPERATURES,
          num_verified: int | None = None) -> None:
    for _ in range(num_updates):
        logits, num_accepted = _synthetic_rounds(generator, num_reqs, temperatures)
        verified = torch.full_like(num_accepted, num_verified or len(temperatures))
        calibrator.update(logits=logits, num_verified=verified,
                          num_accepted=num_accepted.minimum(verified))


def test_online_calibrator_converges():
    calibrator = OnlineCalibrator(num_positions=4)
    assert calibrator.temperatures == (1.0,) * 4  # cold start
    _feed(calibrator, torch.Generator().manual_seed(4), num_updates=1500)
    for fitted, true in zip(calibrator.temperatures, TRUE_TEMPERATURES):
        # Grid step is 2^(1/8) ~ 1.09; binning the logits costs about one more step.
        assert abs(math.log(fitted / true)) < math.log(1.25), calibrator.temperatures
    stats = calibrator.stats()
    assert stats["trials"][0] > stats["trials"][3] > 0  # later positions are reached less often


def test_online_calibrator_cold_start_off_switch_and_bounds():
    initial = STSCalibration(temperatures=(1.5, 1.5))
    cold = OnlineCalibrator(num_positions=2, initial=initial,
                            config=OnlineCalibrationConfig(min_trials=1e9, refit_every=1))
    _feed(cold, torch.Generator().manual_seed(5), num_updates=20, temperatures=(8.0, 8.0))
    assert cold.temperatures == (1.5, 1.5)  # too few trials: the initial (offline) values stay

    off = OnlineCalibrator(num_positions=2, config=OnlineCalibrationConfig(enabled=False))
    _feed(off, torch.Generator().manual_seed(5), num_updates=50, temperatures=(4.0, 4.0))
    assert off.temperatures == (1.0, 1.0) and off.stats()["trials"] == [0.0, 0.0]

    bounded = OnlineCalibrator(num_positions=2, config=OnlineCalibrationConfig(refit_every=8))
    _feed(bounded, torch.Generator().manual_seed(5), num_updates=200, temperatures=(50.0, 50.0))
    assert bounded.temperatures == pytest.approx((8.0, 8.0))  # clamped to the grid's top


def test_online_calibrator_shrinks_sparse_positions_to_pooled_fit():
    # Position 3 is verified in 1 round of 64 per update, and its true T (0.25) differs from the
    # others' (2.0); with ~40 decayed trials vs a prior weight of 64 it is pulled to the pooled fit
    # (without the prior it would fit ~0.35).
    calibrator = OnlineCalibrator(num_positions=3, config=OnlineCalibrationConfig(decay=0.99))
    generator = torch.Generator().manual_seed(6)
    for _ in range(400):
        logits, num_accepted = _synthetic_rounds(generator, 64, (2.0, 2.0, 0.25))
        num_verified = torch.full_like(num_accepted, 2)
        num_verified[0] = 3
        calibrator.update(logits=logits, num_verified=num_verified,
                          num_accepted=num_accepted.minimum(num_verified))
    first, second, sparse = calibrator.temperatures
    assert abs(math.log(first / 2.0)) < math.log(1.25)
    assert sparse > 1.0, calibrator.temperatures  # pulled toward ~2, far from its own 0.25
