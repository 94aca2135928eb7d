"""Verification of draft tokens against the target: accepted / recovered / bonus.

Two lanes, routed per request by the sampler (`sampler.py`, the engine's verifier):

* greedy (`accept_greedy`, `verify_greedy_argmax`) — compare only: draft k is accepted while it equals the target argmax at k; the
  token after the accepted prefix is the target argmax there (recovered on a mismatch, bonus when
  every draft was accepted). No randomness.
* rejection sampling (`verify_one_rejection`) — lossless speculative sampling: draft k is accepted with probability
  min(1, target(d_k) / draft(d_k)); at the first rejection a recovered token is drawn from
  normalize(max(target - draft, 0)); if every draft is accepted a bonus token is drawn from the
  target row after the last draft. Drafts without a distribution (`draft_probs=None`: n-gram or
  greedy drafters) are point masses, for which the same rule reads: accept with probability
  target(d_k), recover from the target row with d_k zeroed and renormalised.

The emitted tokens are distributed exactly as if sampled from the target one at a time, whatever the
drafts were. A one-hot (greedy) target row makes rejection sampling reproduce the greedy lane.

`rejection_sample_batched` is the vectorised core: the per-request path calls it with one row, and
the Monte-Carlo tests call it with 10^5 rows (tests/verify_reference.py routes a batch through the two lanes
as the sampler does). Randomness comes only from the caller's
`torch.Generator` (per request), consumed in a fixed order: `verify_len` uniforms, then one more
uniform for the inverse-CDF draw of the recovered/bonus token.

    pytest tests/test_verify.py -q
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = ["VerifyResult", "accept_greedy", "rejection_sample_batched", "verify_greedy_argmax",
           "verify_one_rejection"]

# Guards the draft probability in the acceptance ratio and decides when a residual is empty
# (DeepSpec's constants, `base_evaluator.py` / `sampling.py`).
_MIN_DRAFT_PROB = 1e-8
_MIN_RESIDUAL_MASS = 1e-8


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification step, one entry per request (same order as the inputs)."""

    num_accepted: list[int]  # [num_reqs] accepted draft tokens
    output_ids: list[list[int]]  # [num_reqs][num_accepted + 1]: accepted + (recovered or bonus)
    is_bonus: list[bool]  # [num_reqs] the last token is a bonus (every draft was accepted)

    @property
    def num_emitted(self) -> list[int]:  # [num_reqs] num_accepted + 1
        return [len(ids) for ids in self.output_ids]


def rejection_sample_batched(
    *,
    target_probs: torch.Tensor,  # [num_rows, verify_len + 1, vocab_size] float32
    draft_ids: torch.Tensor,  # [num_rows, verify_len] int64
    draft_probs: torch.Tensor | None,  # [num_rows, verify_len, vocab_size] or None (point masses)
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_rows] num_accepted, [num_rows] final token id)
    """Rejection sampling for independent rows sharing one verify_len, fully vectorised.

    The final token is the recovered token when `num_accepted < verify_len`, else the bonus token.
    Row i's emitted tokens are `draft_ids[i, :num_accepted[i]]` followed by the final token."""
    num_rows, num_positions, _ = target_probs.shape
    verify_len = num_positions - 1
    if draft_ids.shape != (num_rows, verify_len):
        raise ValueError(f"draft_ids must be [{num_rows}, {verify_len}], "
                         f"got {tuple(draft_ids.shape)}")
    device = target_probs.device
    rows = torch.arange(num_rows, device=device)
    if verify_len == 0:
        final_ids = _sample_rows(target_probs[:, 0], generator)
        return torch.zeros(num_rows, dtype=torch.long, device=device), final_ids

    draft_ids = draft_ids.long()
    target_at_draft = target_probs[:, :verify_len].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    if draft_probs is None:  # point mass: draft(d_k) = 1
        accept_prob = target_at_draft  # [num_rows, verify_len]
    else:
        draft_at_draft = draft_probs[:, :verify_len].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
        accept_prob = (target_at_draft / draft_at_draft.clamp_min(_MIN_DRAFT_PROB)).clamp_max(1.0)
    uniforms = _uniform((num_rows, verify_len), generator, device)  # [num_rows, verify_len]
    accepted = uniforms < accept_prob  # u in [0, 1): ratio 1 always accepts, ratio 0 never does
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_rows] length of accepted prefix

    # The row that supplies the final token: position num_accepted (the bonus row when it equals
    # verify_len). On a rejection the draft distribution at that position is subtracted.
    target_row = target_probs[rows, num_accepted]  # [num_rows, vocab_size]
    rejected = num_accepted < verify_len  # [num_rows]
    reject_pos = num_accepted.clamp_max(verify_len - 1)  # [num_rows]
    if draft_probs is None:
        # max(target - one_hot(d), 0) is the target row with d zeroed.
        draft_row = torch.zeros_like(target_row)
        draft_row.scatter_(1, draft_ids[rows, reject_pos].unsqueeze(1), 1.0)
    else:
        draft_row = draft_probs[rows, reject_pos]  # [num_rows, vocab_size]
    residual = torch.where(rejected.unsqueeze(1), (target_row - draft_row).clamp_min(0.0),
                           target_row)  # [num_rows, vocab_size]
    residual_mass = residual.sum(dim=1, keepdim=True)  # [num_rows, 1]
    # Empty residual (target == draft up to rounding): any token drawn from the target is exact.
    residual = torch.where(residual_mass > _MIN_RESIDUAL_MASS, residual, target_row)
    final_ids = _sample_rows(residual, generator)  # [num_rows]
    return num_accepted, final_ids


def _sample_rows(
    weights: torch.Tensor,  # [num_rows, vocab_size] non-negative, unnormalised, positive row sums
    generator: torch.Generator | None,
) -> torch.Tensor:  # [num_rows] int64
    """One token per row by inverse CDF in float64 (several times faster than torch.multinomial on
    CPU at LLM vocab sizes). Zero-weight tokens are never drawn: the draw u*total lies in
    [cdf[i-1], cdf[i]) only for tokens with weight > 0."""
    cdf = weights.double().cumsum(dim=1)  # [num_rows, vocab_size]
    # float64 uniforms: 53-bit resolution, so even 1e-9-probability tokens are drawn at their rate.
    u = _uniform((weights.shape[0], 1), generator, weights.device, torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(weights.shape[1] - 1)


def _uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """U[0, 1) drawn on the generator's device (a CPU generator may serve device tensors)."""
    source = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=source, dtype=dtype).to(device)


def verify_greedy_argmax(
    *,
    target_argmax: list[list[int]],  # per request [verify_len + 1] argmax of the target logits
    draft_ids: list[list[int]],  # per request [verify_len]
) -> VerifyResult:
    """The compare-only lane from the target's argmax ids: for an all-greedy batch the engine takes one
    argmax over the logits instead of building one-hot distributions (`verify` with one-hot rows gives
    the same result)."""
    check_lengths(len(target_argmax), draft_ids=draft_ids)
    results = []
    for ids, drafts in zip(target_argmax, draft_ids):
        if len(ids) != len(drafts) + 1:
            raise ValueError(f"target_argmax needs verify_len + 1 = {len(drafts) + 1} ids, got {len(ids)}")
        results.append(accept_greedy(ids, drafts))
    return VerifyResult(num_accepted=[r[0] for r in results], output_ids=[r[1] for r in results],
                        is_bonus=[r[2] for r in results])


def accept_greedy(
    target_argmax: list[int],  # [verify_len + 1]
    draft_ids: list[int],  # [verify_len]
) -> tuple[int, list[int], bool]:
    verify_len = len(draft_ids)
    num_accepted = 0
    while num_accepted < verify_len and draft_ids[num_accepted] == target_argmax[num_accepted]:
        num_accepted += 1
    output_ids = list(draft_ids[:num_accepted]) + [target_argmax[num_accepted]]
    return num_accepted, output_ids, num_accepted == verify_len


def verify_one_rejection(
    target_probs: torch.Tensor,  # [verify_len + 1, vocab_size]
    draft_ids: list[int],  # [verify_len]
    draft_probs: torch.Tensor | None,  # [>= verify_len, vocab_size] or None
    generator: torch.Generator | None,
) -> tuple[int, list[int], bool]:
    verify_len = len(draft_ids)
    check_target_rows(target_probs, verify_len)
    if draft_probs is not None:
        if draft_probs.shape[0] < verify_len or draft_probs.shape[-1] != target_probs.shape[-1]:
            raise ValueError(f"draft_probs must be [>= {verify_len}, {target_probs.shape[-1]}], "
                             f"got {tuple(draft_probs.shape)}")
        draft_probs = draft_probs[:verify_len].float().unsqueeze(0)
    num_accepted, final_ids = rejection_sample_batched(
        target_probs=target_probs.float().unsqueeze(0),
        draft_ids=torch.tensor([draft_ids], dtype=torch.long,
                               device=target_probs.device).view(1, verify_len),
        draft_probs=draft_probs,
        generator=generator,
    )
    accepted = int(num_accepted.item())
    return accepted, list(draft_ids[:accepted]) + [int(final_ids.item())], accepted == verify_len


def check_target_rows(target_probs: torch.Tensor, verify_len: int) -> None:
    if target_probs.dim() != 2 or target_probs.shape[0] != verify_len + 1:
        raise ValueError(f"target_probs must be [verify_len + 1 = {verify_len + 1}, vocab_size], "
                         f"got {tuple(target_probs.shape)}")


def check_lengths(num_reqs: int, **per_request: list) -> None:
    for name, values in per_request.items():
        if len(values) != num_reqs:
            raise ValueError(f"{name} has {len(values)} entries, "
                             f"expected one per request ({num_reqs})")
