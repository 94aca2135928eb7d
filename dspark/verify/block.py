"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025): lossless
verification of drafts sampled from a drafter's distribution that looks at the whole block at once.

Token-by-token rejection sampling (`rejection.py`) accepts draft k with probability min(1, target / draft) at k
alone, so a draft that the target under-weights at k ends the block even where the block as a whole is likely
under the target. Block verification carries a weight p along the block and accepts the longest prefix whose
test passes, with residuals that keep the emitted tokens distributed exactly as the target's. With target rows
M_b(.|X^i) (i = 0..γ) and draft rows M_s(.|X^i) (i = 0..γ-1) for the drafts X_1..X_γ:

    p_0 = 1,   p_i = min(1, p_{i-1} · M_b(X_i | X^{i-1}) / M_s(X_i | X^{i-1}))
    r_i = Σ_x max(p_i · M_b(x | X^i) − M_s(x | X^i), 0)                      (i < γ)
    h_i = r_i / (r_i + 1 − p_i)  (i < γ; 1 where both are 0),   h_γ = p_γ
    τ = the largest i with η_i < h_i (η_i ~ U[0, 1)), 0 where there is none
    the token after X^τ: drawn from M_b(.|X^γ) when τ = γ, else from max(p_τ · M_b(.|X^τ) − M_s(.|X^τ), 0)

With one draft this is token-by-token rejection sampling; its expected accepted length is never below
token-by-token's on the same drafts (the paper's Theorem 2), and with point-mass drafts (greedy drafters) the
two accept alike, so the engine uses it for `draft_sample_method="probabilistic"` only
(`SpecConfig.rejection_sample_method="block"`). Randomness, as in `rejection.py`, only from the caller's
generator: γ uniforms, then one for the inverse-CDF draw of the final token.

    pytest tests/test_block_verification.py -q
"""

from __future__ import annotations

import torch

from dspark.verify.rejection import _MIN_DRAFT_PROB, _MIN_RESIDUAL_MASS, _sample_rows, _uniform


def block_verify_batched(
    *,
    target_probs: torch.Tensor,  # [num_rows, verify_len + 1, vocab_size] float32
    draft_ids: torch.Tensor,  # [num_rows, verify_len] int64
    draft_probs: torch.Tensor,  # [num_rows, verify_len, vocab_size] float32
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_rows] num_accepted, [num_rows] final token id)
    """Block verification for independent rows sharing one verify_len (the same contract as
    `rejection.rejection_sample_batched`)."""
    num_rows, num_positions, _ = target_probs.shape
    verify_len = num_positions - 1
    if draft_ids.shape != (num_rows, verify_len) or draft_probs.shape[:2] != (num_rows, verify_len):
        raise ValueError(f"draft_ids / draft_probs must be [{num_rows}, {verify_len}(, vocab)], "
                         f"got {tuple(draft_ids.shape)} / {tuple(draft_probs.shape)}")
    device = target_probs.device
    rows = torch.arange(num_rows, device=device)
    if verify_len == 0:
        return torch.zeros(num_rows, dtype=torch.long, device=device), _sample_rows(target_probs[:, 0], generator)

    draft_ids = draft_ids.long()
    ratio = (target_probs[:, :verify_len].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
             / draft_probs.gather(2, draft_ids.unsqueeze(2)).squeeze(2).clamp_min(_MIN_DRAFT_PROB))  # [rows, γ]
    weights = torch.ones(num_rows, verify_len + 1, device=device)  # [rows, γ + 1]: p_0 .. p_γ
    for i in range(1, verify_len + 1):
        weights[:, i] = (weights[:, i - 1] * ratio[:, i - 1]).clamp_max(1.0)
    # r_i for i < γ: the residual mass at the row after X^i, weighted by p_i
    residuals = (weights[:, 1:verify_len, None] * target_probs[:, 1:verify_len]
                 - draft_probs[:, 1:verify_len]).clamp_min(0.0)  # [rows, γ - 1, vocab]
    mass = residuals.sum(dim=2)  # [rows, γ - 1]
    denominator = mass + 1.0 - weights[:, 1:verify_len]
    h_inner = torch.where(denominator > _MIN_RESIDUAL_MASS, mass / denominator.clamp_min(_MIN_RESIDUAL_MASS),
                          torch.ones_like(mass))
    h = torch.cat([h_inner, weights[:, verify_len:]], dim=1)  # [rows, γ]: h_1 .. h_γ
    passed = _uniform((num_rows, verify_len), generator, device) < h  # [rows, γ]
    positions = torch.arange(1, verify_len + 1, device=device)
    num_accepted = (passed * positions).amax(dim=1)  # [rows]: the largest i that passed, 0 if none

    target_row = target_probs[rows, num_accepted]  # [rows, vocab]: the row after X^τ
    rejected = num_accepted < verify_len
    draft_row = draft_probs[rows, num_accepted.clamp_max(verify_len - 1)]  # [rows, vocab]
    residual = torch.where(rejected.unsqueeze(1),
                           (weights[rows, num_accepted].unsqueeze(1) * target_row - draft_row).clamp_min(0.0),
                           target_row)
    # an empty residual (rounding where target and draft agree): any token drawn from the target is exact
    residual = torch.where(residual.sum(dim=1, keepdim=True) > _MIN_RESIDUAL_MASS, residual, target_row)
    return num_accepted, _sample_rows(residual, generator)


def verify_one_block(
    target_probs: torch.Tensor,  # [verify_len + 1, vocab_size]
    draft_ids: list[int],  # [verify_len]
    draft_probs: torch.Tensor,  # [>= verify_len, vocab_size]
    generator: torch.Generator | None,
) -> tuple[int, list[int], bool]:
    """One request's block verification: (accepted, emitted ids, the last one is a bonus)."""
    verify_len = len(draft_ids)
    num_accepted, final_ids = block_verify_batched(
        target_probs=target_probs.float().unsqueeze(0),
        draft_ids=torch.tensor([draft_ids], dtype=torch.long, device=target_probs.device).view(1, verify_len),
        draft_probs=draft_probs[:verify_len].float().unsqueeze(0), generator=generator)
    accepted = int(num_accepted.item())
    return accepted, list(draft_ids[:accepted]) + [int(final_ids.item())], accepted == verify_len
