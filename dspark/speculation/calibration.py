"""Confidence calibration for the length policies: survival, Sequential Temperature Scaling (STS),
ECE / AUROC diagnostics, reliability diagrams, and an online per-position temperature tracker.

Vocabulary: the drafter emits a confidence *logit* z_k per draft position; the conditional
confidence is c_k = σ(z_k / T_k) (acceptance of draft k given drafts 1..k-1 were accepted) and the
survival is a_k = Π_{i≤k} c_i (probability that drafts 1..k are all accepted). A verified round
gives num_accepted and num_verified; its survival labels are Y_k = 1[num_accepted ≥ k], observed for
k ≤ num_verified.

* `fit_sts` — the paper's offline STS (reference §5.6): for k = 1..γ in order, grid-search T_k to
  minimise the 20-bin ECE of the *cumulative* product Π_{i<k} σ(z_i/T_i) · σ(z_k/t) against Y_k,
  over rounds where position k was verified, holding T_1..T_{k-1} fixed. Saved as JSON next to the
  drafter (`calibration.json`: `dspark.drafters.dspark.CALIBRATION_NAME`). Optionally (`bias_grid`) a shift b_k per position is searched with
  T_k, c_k = σ(z_k/T_k + b_k): our extension, for heads whose error is a bias rather than a scale.
* `OnlineCalibrator` — vLLM-style online upkeep (reference §7.5): per position, exponentially
  decayed counts of trials/hits of the *conditional* outcome in logit bins; T_k on a log grid
  minimising the trial-weighted |σ(mid/T) − empirical rate|, shrunk toward a fit pooled over
  positions; T = 1 (or the offline STS value) until enough trials arrive. Bounded (temperatures on
  the grid, counts decayed), logged on every refit that changes a temperature, and switchable off.

    pytest tests/test_calibration.py -q
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["STS_BIAS_GRID", "survival", "survival_labels", "verified_mask",
           "expected_calibration_error", "auroc",
           "STSCalibration", "fit_sts", "calibration_report", "plot_reliability",
           "OnlineCalibrationConfig", "OnlineCalibrator"]

logger = logging.getLogger(__name__)

# Offline STS grid: 121 log-spaced temperatures in [0.05, 20], symmetric about (and containing) 1.
STS_GRID = tuple(float(t) for t in torch.logspace(math.log10(0.05), math.log10(20.0), 121,
                                                  dtype=torch.float64))
# Optional shifts searched with `fit_sts(..., bias_grid=STS_BIAS_GRID)`: 0.1 apart in [-4, 4].
STS_BIAS_GRID = tuple(round(0.1 * i, 10) for i in range(-40, 41))


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """a_k = Π_{i≤k} c_i along the last (position) axis: [..., num_positions] -> same shape."""
    return confidence.cumprod(dim=-1)


def survival_labels(
    num_accepted: torch.Tensor,  # [num_rounds] accepted drafts per verified round
    num_positions: int,
) -> torch.Tensor:  # [num_rounds, num_positions] bool, Y_k = drafts 1..k all accepted
    return torch.arange(1, num_positions + 1).view(1, -1) <= num_accepted.view(-1, 1)


def verified_mask(
    num_verified: torch.Tensor | None,  # [num_rounds]
    num_rounds: int,
    num_positions: int,
) -> torch.Tensor:  # [num_rounds, num_positions] bool
    """Position k was verified in that round (all True when num_verified is None)."""
    if num_verified is None:
        return torch.ones(num_rounds, num_positions, dtype=torch.bool)
    return torch.arange(1, num_positions + 1).view(1, -1) <= num_verified.view(-1, 1)


def expected_calibration_error(
    predictions: torch.Tensor,  # [num_samples] probabilities in [0, 1]
    labels: torch.Tensor,  # [num_samples] 0/1
    *,
    num_bins: int = 20,
) -> float:
    """Σ_b (n_b / N) · |mean prediction − mean label| over equal-width bins on [0, 1]."""
    return float(_ece_rows(predictions.double().view(1, -1), labels.double().view(-1),
                           num_bins=num_bins)[0])


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve via the rank-sum (Mann-Whitney) statistic, ties at half credit;
    NaN when only one class is present."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    num_pos, num_neg = int(labels.sum()), int((~labels).sum())
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    sorted_scores, order = scores.sort()
    # Average 1-based rank over each run of tied scores.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True,
                                                  return_counts=True)
    run_end = counts.cumsum(0).double()  # [num_unique] 1-based rank of each run's last element
    run_mean_rank = run_end - (counts.double() - 1) / 2
    ranks = torch.empty_like(scores)
    ranks[order] = run_mean_rank[inverse]
    rank_sum = float(ranks[labels].sum())
    return (rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)


@dataclass(frozen=True)
class STSCalibration:
    """Per-position temperatures and optional shifts; c_k = σ(z_k / T_k + b_k) (b_k = 0: plain STS).
    Both are monotone in z_k, so a position's AUROC is unchanged."""

    temperatures: tuple[float, ...]  # [num_positions]
    biases: tuple[float, ...] | None = None  # [num_positions]; None = all zero

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        if not self.temperatures or any(not t > 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of positive numbers, "
                             f"got {self.temperatures}")
        if self.biases is not None:
            object.__setattr__(self, "biases", tuple(float(b) for b in self.biases))
            if len(self.biases) != len(self.temperatures) or not all(map(math.isfinite, self.biases)):
                raise ValueError(f"biases must be {len(self.temperatures)} finite numbers, got {self.biases}")

    @classmethod
    def identity(cls, num_positions: int) -> STSCalibration:
        return cls(temperatures=(1.0,) * num_positions)

    def bias(self, k: int) -> float:
        return 0.0 if self.biases is None else self.biases[k]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Conditional confidences: logits [..., num_positions] -> same shape, in (0, 1)."""
        num_positions = logits.shape[-1]
        if num_positions > len(self.temperatures):
            raise ValueError(f"calibration has {len(self.temperatures)} positions, logits have "
                             f"{num_positions}")
        temps = torch.tensor(self.temperatures[:num_positions], dtype=logits.dtype,
                             device=logits.device)
        shift = torch.tensor([self.bias(k) for k in range(num_positions)], dtype=logits.dtype,
                             device=logits.device)
        return torch.sigmoid(logits / temps + shift)

    def to_dict(self) -> dict:
        out = {"method": "sts", "temperatures": list(self.temperatures)}
        if self.biases is not None:
            out["biases"] = list(self.biases)
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> STSCalibration:
        data = json.loads(Path(path).read_text())
        if data.get("method") != "sts" or not {"method", "temperatures"} <= set(data) <= {
                "method", "temperatures", "biases"}:
            raise ValueError(f"{path}: not an STS calibration file (keys {sorted(data)})")
        return cls(temperatures=tuple(data["temperatures"]), biases=data.get("biases"))


def fit_sts(
    *,
    logits: torch.Tensor,  # [num_rounds, num_positions] held-out confidence logits
    num_accepted: torch.Tensor,  # [num_rounds]
    num_verified: torch.Tensor | None = None,  # [num_rounds]; None: every position verified
    grid: Sequence[float] = STS_GRID,
    num_bins: int = 20,
    bias_grid: Sequence[float] | None = None,
) -> STSCalibration:
    """Sequential Temperature Scaling (reference §5.6). Among grid temperatures with equal ECE the
    one closest to 1 wins; a position with no verified rounds keeps T = 1.

    `bias_grid` (e.g. `STS_BIAS_GRID`) also searches a shift b_k per position, c_k = σ(z_k/T_k + b_k),
    jointly with T_k and in the same sequential order: a temperature can sharpen or soften a head but
    cannot move a head that is too confident everywhere (its shift is 0 when that is as good)."""
    logits = logits.double()
    num_rounds, num_positions = logits.shape
    labels = survival_labels(num_accepted, num_positions).double()  # [num_rounds, num_positions]
    verified = verified_mask(num_verified, num_rounds, num_positions)
    grid_t = torch.tensor(list(grid), dtype=torch.float64)  # [grid_size]
    shifts = torch.tensor(list(bias_grid) if bias_grid is not None else [0.0], dtype=torch.float64)
    prefix = torch.ones(num_rounds, dtype=torch.float64)  # Π_{i<k} c_i, [num_rounds]
    temperatures, biases = [], []
    for k in range(num_positions):
        rows = verified[:, k]
        best_t, best_b, best_score = 1.0, 0.0, (math.inf, math.inf)
        if bool(rows.any()):
            for b in shifts.tolist():  # one [grid_size, num_rows] block per shift keeps memory small
                candidates = prefix[rows].view(1, -1) * torch.sigmoid(
                    logits[rows, k].view(1, -1) / grid_t.view(-1, 1) + b)  # [grid_size, num_rows]
                ece = _ece_rows(candidates, labels[rows, k], num_bins=num_bins)  # [grid_size]
                # lowest ECE; ties go to the smallest change (|log T| + |b|)
                score = ece + 1e-12 * (grid_t.log().abs() + abs(b))
                i = int(score.argmin())
                key = (round(float(ece[i]), 12), float(grid_t[i].log().abs()) + abs(b))
                if key < best_score:
                    best_t, best_b, best_score = float(grid_t[i]), b, key
        temperatures.append(best_t)
        biases.append(best_b)
        prefix = prefix * torch.sigmoid(logits[:, k] / best_t + best_b)
    return STSCalibration(temperatures=tuple(temperatures),
                          biases=tuple(biases) if bias_grid is not None else None)


def calibration_report(
    *,
    logits: torch.Tensor,  # [num_rounds, num_positions]
    num_accepted: torch.Tensor,  # [num_rounds]
    num_verified: torch.Tensor | None = None,  # [num_rounds]
    calibration: STSCalibration | None = None,  # None: raw σ(z)
    num_bins: int = 20,
) -> list[dict[str, float]]:  # [num_positions] {"position", "num_rounds", "ece", "auroc", "brier"}
    """Per-position diagnostics of the cumulative survival (DeepSpec's protocol, reference §5.5)."""
    num_rounds, num_positions = logits.shape
    calibration = calibration or STSCalibration.identity(num_positions)
    predictions = survival(calibration.apply(logits.double()))
    labels = survival_labels(num_accepted, num_positions).double()
    verified = verified_mask(num_verified, num_rounds, num_positions)
    report = []
    for k in range(num_positions):
        pred, label = predictions[verified[:, k], k], labels[verified[:, k], k]
        empty = pred.numel() == 0
        report.append({
            "position": k + 1, "num_rounds": int(pred.numel()),
            "ece": math.nan if empty else expected_calibration_error(pred, label,
                                                                     num_bins=num_bins),
            "auroc": auroc(pred, label),
            "brier": math.nan if empty else float(((pred - label) ** 2).mean()),
        })
    return report


def plot_reliability(
    *,
    curves: Mapping[str, tuple[torch.Tensor, torch.Tensor]],  # name -> ([num_samples] predictions,
    #                                                                    [num_samples] 0/1 labels)
    path: str | Path,
    num_bins: int = 20,
    title: str = "",
) -> None:
    """Reliability diagram (mean label vs mean prediction per bin, one line per curve) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1, label="perfect")
    for name, (pred, label) in curves.items():
        pred, label = pred.double().flatten(), label.double().flatten()
        bins = (pred * num_bins).long().clamp(0, num_bins - 1)
        counts = torch.bincount(bins, minlength=num_bins).double()
        mean_pred = torch.bincount(bins, weights=pred, minlength=num_bins) / counts.clamp_min(1)
        mean_label = torch.bincount(bins, weights=label, minlength=num_bins) / counts.clamp_min(1)
        used = counts > 0
        ece = expected_calibration_error(pred, label, num_bins=num_bins)
        ax.plot(mean_pred[used].numpy(), mean_label[used].numpy(), marker="o", markersize=3,
                label=f"{name} (ECE {100 * ece:.1f}%)")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted survival", ylabel="observed acceptance",
           title=title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ece_rows(
    predictions: torch.Tensor,  # [num_rows, num_samples] one candidate calibration per row
    labels: torch.Tensor,  # [num_samples]
    *,
    num_bins: int,
) -> torch.Tensor:  # [num_rows] ECE of each row; Σ_b |Σ pred − Σ label| / N
    num_rows, num_samples = predictions.shape
    bins = (predictions * num_bins).long().clamp(0, num_bins - 1)  # [num_rows, num_samples]
    flat = (bins + num_bins * torch.arange(num_rows).view(-1, 1)).flatten()
    pred_sum = torch.bincount(flat, weights=predictions.flatten().double(),
                              minlength=num_rows * num_bins)
    label_sum = torch.bincount(flat, weights=labels.double().expand(num_rows, -1).flatten(),
                               minlength=num_rows * num_bins)
    gap = (pred_sum - label_sum).abs().view(num_rows, num_bins)  # [num_rows, num_bins]
    return gap.sum(dim=1) / max(num_samples, 1)


# --------------------------------------------------------------------------------------------------
# Online upkeep


@dataclass(frozen=True)
class OnlineCalibrationConfig:
    enabled: bool = True  # False: update() is a no-op and the initial temperatures are kept
    num_bins: int = 16  # logit bins over [-logit_range, logit_range]
    logit_range: float = 8.0
    decay: float = 0.999  # per update() call
    grid_size: int = 49  # log-spaced temperatures in [min_temperature, max_temperature]
    min_temperature: float = 0.125
    max_temperature: float = 8.0
    prior_weight: float = 64.0  # pseudo-trials pulling each position toward the pooled fit
    min_trials: float = 64.0  # pooled decayed trials before leaving the cold start
    refit_every: int = 32  # update() calls between refits

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not 0.0 < self.min_temperature <= 1.0 <= self.max_temperature:
            raise ValueError("need 0 < min_temperature <= 1 <= max_temperature")
        if self.num_bins < 1 or self.grid_size < 2 or self.refit_every < 1:
            raise ValueError("num_bins, grid_size (>= 2) and refit_every must be positive")


class OnlineCalibrator:
    """Per-position temperatures refreshed from live verification outcomes (conditional)."""

    def __init__(self, *, num_positions: int, config: OnlineCalibrationConfig | None = None,
                 initial: STSCalibration | None = None) -> None:
        config = config or OnlineCalibrationConfig()
        self.config = config
        self.num_positions = num_positions
        self.initial = initial or STSCalibration.identity(num_positions)
        self.calibration = self.initial
        self._trials = torch.zeros(num_positions, config.num_bins, dtype=torch.float64)
        self._hits = torch.zeros(num_positions, config.num_bins, dtype=torch.float64)
        self._num_updates = 0
        width = 2 * config.logit_range / config.num_bins
        self._bin_mids = -config.logit_range + width * (torch.arange(config.num_bins) + 0.5)
        self._grid = torch.logspace(math.log10(config.min_temperature),
                                    math.log10(config.max_temperature), config.grid_size,
                                    dtype=torch.float64)  # [grid_size]

    @property
    def temperatures(self) -> tuple[float, ...]:
        return self.calibration.temperatures

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [..., num_positions] -> conditional c
        return self.calibration.apply(logits)

    def update(
        self,
        *,
        logits: torch.Tensor,  # [num_reqs, num_positions] raw confidence logits of verified drafts
        num_verified: torch.Tensor,  # [num_reqs] drafts the target verified
        num_accepted: torch.Tensor,  # [num_reqs]
    ) -> None:
        """Position k is a trial when drafts before it were accepted and it was verified; a hit when
        it was accepted too."""
        if not self.config.enabled:
            return
        cfg = self.config
        positions = torch.arange(self.num_positions).view(1, -1)  # [1, num_positions]
        trial = (positions <= num_accepted.view(-1, 1)) & (positions < num_verified.view(-1, 1))
        hit = positions < num_accepted.view(-1, 1)  # implies trial
        bins = ((logits.detach().double().cpu() + cfg.logit_range) * cfg.num_bins
                / (2 * cfg.logit_range)).floor().long().clamp(0, cfg.num_bins - 1)
        flat = (bins + cfg.num_bins * positions).flatten()  # [num_reqs * num_positions]
        size = self.num_positions * cfg.num_bins
        new_trials = torch.bincount(flat, weights=trial.double().flatten(), minlength=size)
        new_hits = torch.bincount(flat, weights=(hit & trial).double().flatten(), minlength=size)
        self._trials.mul_(cfg.decay).add_(new_trials.view(self.num_positions, cfg.num_bins))
        self._hits.mul_(cfg.decay).add_(new_hits.view(self.num_positions, cfg.num_bins))
        self._num_updates += 1
        if self._num_updates % cfg.refit_every == 0:
            self.refit()

    def refit(self) -> tuple[float, ...]:
        """Recompute the temperatures from the decayed counts (kept at the initial values during the
        cold start); logs the change."""
        if float(self._trials.sum()) < self.config.min_trials:
            return self.temperatures
        temperatures = []
        for k in range(self.num_positions):  # the offline shift b_k stays; only T_k is refitted
            bias = self.initial.bias(k)
            pooled_loss = self._loss(self._trials.sum(0), self._hits.sum(0), bias)  # [grid_size]
            pooled_loss = pooled_loss / float(self._trials.sum())  # per trial
            own_loss = self._loss(self._trials[k], self._hits[k], bias)  # [grid_size]
            loss = own_loss + self.config.prior_weight * pooled_loss
            temperatures.append(float(self._grid[int(loss.argmin())]))
        old, self.calibration = self.temperatures, STSCalibration(temperatures=tuple(temperatures),
                                                                  biases=self.initial.biases)
        if any(abs(math.log(a / b)) > 1e-9 for a, b in zip(old, self.temperatures)):
            logger.info("online calibration: temperatures %s -> %s (%.0f decayed trials)",
                        _fmt(old), _fmt(self.temperatures), float(self._trials.sum()))
        return self.temperatures

    def stats(self) -> dict[str, object]:
        """For /metrics and logs: decayed trials and observed conditional rates per position."""
        trials = self._trials.sum(1)
        return {"temperatures": list(self.temperatures), "trials": trials.tolist(),
                "acceptance": (self._hits.sum(1) / trials.clamp_min(1e-12)).tolist()}

    def _loss(
        self,
        trials: torch.Tensor,  # [num_bins]
        hits: torch.Tensor,  # [num_bins]
        bias: float = 0.0,
    ) -> torch.Tensor:  # [grid_size] Σ_b trials_b · |σ(mid_b / T + bias) − hits_b / trials_b|
        rate = hits / trials.clamp_min(1e-12)
        predicted = torch.sigmoid(self._bin_mids.view(1, -1) / self._grid.view(-1, 1) + bias)
        return (trials.view(1, -1) * (predicted - rate.view(1, -1)).abs()).sum(dim=1)


def _fmt(temperatures: Sequence[float]) -> str:
    return "[" + ", ".join(f"{t:.3g}" for t in temperatures) + "]"
