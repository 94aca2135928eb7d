"""The per-request verification reference the Monte-Carlo tests drive: a batch routed through the two lanes of
`dspark.verify.rejection` (greedy requests compare, the others rejection-sample) exactly as the engine's
sampler (`dspark.verify.sampler.sample_step`) routes its rows, from processed target distributions."""

from __future__ import annotations

import torch

from dspark.sampling import greedy_ids
from dspark.verify.rejection import (VerifyResult, accept_greedy, check_lengths, check_target_rows,
                                     verify_one_rejection)


def verify(
    *,
    target_probs: list[torch.Tensor],  # per request [verify_len + 1, vocab_size] float32, processed
    draft_ids: list[list[int]],  # per request [verify_len] (may be empty: plain sampling)
    draft_probs: list[torch.Tensor | None],  # per request [>= verify_len, vocab_size] or None
    is_greedy: list[bool],  # [num_reqs]
    generators: list[torch.Generator | None],  # [num_reqs]
) -> VerifyResult:
    """Verify a mixed batch: greedy requests take the compare-only lane, the others rejection
    sampling.

    `target_probs[i]` must be processed with request i's sampling params (one-hot rows for greedy);
    `draft_probs[i]` must be the exact distribution draft i was sampled from (rows beyond
    `verify_len`, i.e. drafts the length policy cut, are ignored)."""
    num_reqs = len(target_probs)
    check_lengths(num_reqs, draft_ids=draft_ids, draft_probs=draft_probs, is_greedy=is_greedy,
                   generators=generators)
    num_accepted: list[int] = []
    output_ids: list[list[int]] = []
    is_bonus: list[bool] = []
    for i in range(num_reqs):
        if is_greedy[i]:
            accepted, ids, bonus = verify_one_greedy(target_probs[i], draft_ids[i])
        else:
            accepted, ids, bonus = verify_one_rejection(
                target_probs[i], draft_ids[i], draft_probs[i], generators[i])
        num_accepted.append(accepted)
        output_ids.append(ids)
        is_bonus.append(bonus)
    return VerifyResult(num_accepted=num_accepted, output_ids=output_ids, is_bonus=is_bonus)


def verify_greedy(
    *,
    target_probs: list[torch.Tensor],  # per request [verify_len + 1, vocab_size] (argmax used)
    draft_ids: list[list[int]],  # per request [verify_len]
) -> VerifyResult:
    """Compare-only lane for every request (greedy targets)."""
    n = len(target_probs)
    return verify(target_probs=target_probs, draft_ids=draft_ids, draft_probs=[None] * n,
                  is_greedy=[True] * n, generators=[None] * n)


def verify_rejection(
    *,
    target_probs: list[torch.Tensor],  # per request [verify_len + 1, vocab_size] float32
    draft_ids: list[list[int]],  # per request [verify_len]
    draft_probs: list[torch.Tensor | None],  # per request [>= verify_len, vocab_size] or None
    generators: list[torch.Generator | None],  # [num_reqs]
) -> VerifyResult:
    """Lossless rejection-sampling lane for every request."""
    n = len(target_probs)
    return verify(target_probs=target_probs, draft_ids=draft_ids, draft_probs=draft_probs,
                  is_greedy=[False] * n, generators=generators)


def verify_one_greedy(
    target_probs: torch.Tensor,  # [verify_len + 1, vocab_size]
    draft_ids: list[int],  # [verify_len]
) -> tuple[int, list[int], bool]:
    check_target_rows(target_probs, len(draft_ids))
    return accept_greedy(greedy_ids(target_probs).tolist(), draft_ids)
