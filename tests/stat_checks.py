"""Statistical helpers shared by the Monte-Carlo tests (no scipy): Pearson chi-square goodness of
fit against a known distribution, with the exact chi-square tail probability for integer dof
(closed forms of the regularised upper incomplete gamma function at integer and half-integer order).

A correct sampler fails `assert_matches_distribution` with probability `alpha` (1e-6 by default);
the tests also seed their generators, so a run is reproducible.
"""

from __future__ import annotations

import math

import torch


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(chi2_dof >= statistic), exact closed forms for integer dof:
    even dof: exp(-y) * sum_{i < dof/2} y^i / i!;
    odd dof:  erfc(sqrt(y)) + exp(-y) * sum_{j=1}^{(dof-1)/2} y^(j - 1/2) / Gamma(j + 1/2),
    with y = statistic / 2."""
    if math.isinf(statistic):
        return 0.0
    y = statistic / 2.0
    if dof % 2 == 0:
        return math.exp(-y) * sum(y**i / math.factorial(i) for i in range(dof // 2))
    tail = sum(math.exp(-y + (j - 0.5) * math.log(y) - math.lgamma(j + 0.5)) if y > 0 else 0.0
               for j in range(1, (dof - 1) // 2 + 1))
    return math.erfc(math.sqrt(y)) + tail


def chi_square_statistic(
    samples: torch.Tensor,  # [num_samples] int category ids
    expected_probs: torch.Tensor,  # [num_categories], sums to 1
) -> tuple[float, int]:
    """Pearson statistic and dof; a sample in a zero-probability category gives +inf. Categories
    expecting fewer than 5 samples are pooled into one (the usual validity rule)."""
    num_categories = expected_probs.numel()
    counts = torch.bincount(samples.flatten(), minlength=num_categories).double()
    probs = expected_probs.double().flatten()
    possible = probs > 0
    if bool((counts[~possible] > 0).any()):
        return math.inf, int(possible.sum()) - 1
    expected = probs * samples.numel()
    small = possible & (expected < 5)
    keep = possible & ~small
    observed_cells = torch.cat([counts[keep], counts[small].sum().view(1)])
    expected_cells = torch.cat([expected[keep], expected[small].sum().view(1)])
    if not bool(small.any()):
        observed_cells, expected_cells = observed_cells[:-1], expected_cells[:-1]
    elif float(expected_cells[-1]) < 5:  # the pooled cell is still small: fold it into the smallest
        smallest = int(expected_cells[:-1].argmin())
        observed_cells[smallest] += observed_cells[-1]
        expected_cells[smallest] += expected_cells[-1]
        observed_cells, expected_cells = observed_cells[:-1], expected_cells[:-1]
    assert bool((expected_cells >= 5).all()), "too few samples for a chi-square test"
    stat = float(((observed_cells - expected_cells) ** 2 / expected_cells).sum())
    return stat, expected_cells.numel() - 1


def assert_matches_distribution(
    samples: torch.Tensor,  # [num_samples] int category ids
    expected_probs: torch.Tensor,  # [num_categories]
    *,
    alpha: float = 1e-6,
    what: str = "",
) -> None:
    stat, dof = chi_square_statistic(samples, expected_probs)
    p_value = chi_square_sf(stat, dof)
    assert p_value > alpha, (
        f"{what}: chi-square {stat:.1f} (dof {dof}, {samples.numel()} samples), "
        f"p = {p_value:.3g} <= {alpha:g}; a correct sampler fails this with probability {alpha:g}")


def assert_differs_from_distribution(
    samples: torch.Tensor,
    expected_probs: torch.Tensor,
    *,
    alpha: float = 1e-6,
    what: str = "",
) -> None:
    stat, dof = chi_square_statistic(samples, expected_probs)
    p_value = chi_square_sf(stat, dof)
    assert p_value <= alpha, (
        f"{what}: chi-square {stat:.1f} (dof {dof}), p = {p_value:.3g} > {alpha:g}: "
        f"the check did not detect a known bias, so it has no power")
