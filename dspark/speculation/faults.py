"""A drafter's faults never reach verification: a proposal row with a draft id outside the vocabulary, a
non-finite or out-of-[0, 1] confidence, or non-finite / negative / misshapen draft probabilities is dropped
(that request decodes plainly in the next step, `EngineMetrics.num_draft_faults`; plain decoding is speculation
with zero drafts, so greedy output is unchanged). A drafter exception (propose or extend_context): the requests
of that call lose their drafter context (`Request.model_drafting` False, as a request admitted without one) and
decode plainly from then on; each counts as a draft fault. Prompt lookup (`has_free_drafts`) may still draft.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

log = logging.getLogger(__name__)


def _all_sound(proposal, vocab_size: int) -> bool:
    """Every entry of the proposal's ids and confidences in range, checked over the whole tensors (valid
    or not) on the host: the usual case in a few microseconds, where the row-by-row check below costs a
    dozen torch ops a step (~0.2 ms at batch 1). False only sends the proposal to that check."""
    ids, conf = proposal.draft_ids, proposal.confidence
    if proposal.draft_probs is not None or ids.device.type != "cpu" or ids.dim() != 2 or not ids.numel():
        return False
    ids = ids.detach().numpy()
    if ids.min() < 0 or ids.max() >= vocab_size:
        return False
    if conf is None:
        return True
    if conf.device.type != "cpu" or conf.dtype != torch.float32:
        return False
    c = conf.detach().numpy()
    return bool(c.min() >= 0.0) and bool(c.max() <= 1.0)  # NaN fails both comparisons


def faulty_proposal_rows(proposal, *, vocab_size: int, num_valid: list[int]) -> list[int]:
    """Rows of a `DraftProposal` that must not be verified (see the module docstring)."""
    if _all_sound(proposal, vocab_size):
        return []
    ids = proposal.draft_ids  # [num_reqs, γ]
    width = ids.shape[1] if ids.dim() == 2 else 0
    valid = torch.arange(width).unsqueeze(0) < torch.tensor(num_valid).unsqueeze(1)  # [num_reqs, γ]
    bad = ((ids < 0) | (ids >= vocab_size)) & valid
    rows = bad.any(dim=1)
    if proposal.confidence is not None:
        c = proposal.confidence.float()
        rows |= ((~torch.isfinite(c) | (c < 0) | (c > 1)) & valid[:, :c.shape[1]]).any(dim=1)
    out = [i for i, b in enumerate(rows.tolist()) if b]
    if proposal.draft_probs is not None:
        for i, p in enumerate(proposal.draft_probs):
            if p is not None and i not in out and num_valid[i]:
                if p.dim() != 2 or p.shape[0] < num_valid[i] or p.shape[1] != vocab_size:
                    out.append(i)  # [>= num_valid, vocab] or verification could not use it
                    continue
                q = p[:num_valid[i]].float()
                if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
                    out.append(i)
    return sorted(out)


def drop_rows(proposal, rows: list[int], num_valid: list[int]):
    """The proposal with `rows` emptied: zero drafts (num_valid 0), zero ids and confidence."""
    ids = proposal.draft_ids.clone()
    ids[rows] = 0
    confidence = None
    if proposal.confidence is not None:
        confidence = proposal.confidence.clone()
        confidence[rows] = 0.0
    probs = proposal.draft_probs
    if probs is not None:
        probs = [None if i in rows else p for i, p in enumerate(probs)]
    valid = [0 if i in rows else n for i, n in enumerate(num_valid)]
    return replace(proposal, draft_ids=ids, confidence=confidence, draft_probs=probs,
                   num_valid=valid)


def checked_proposal(drafter, metrics, reqs, batch, *, vocab_size: int):
    """`drafter.propose(batch)` with its faulty rows dropped; (None, []) if it raised."""
    try:
        proposal = drafter.propose(batch)
    except Exception:
        drafter_fault(metrics, reqs, "propose")
        return None, []
    num_valid = ([proposal.draft_ids.shape[1]] * len(reqs) if proposal.num_valid is None
                 else list(proposal.num_valid))
    bad = faulty_proposal_rows(proposal, vocab_size=vocab_size, num_valid=num_valid)
    if bad:
        log.warning("dropped faulty drafts (non-finite or out of range) for %d request(s)", len(bad))
        proposal = drop_rows(proposal, bad, num_valid)
        num_valid = list(proposal.num_valid)
        with metrics.lock:
            metrics.num_draft_faults += len(bad)
    return proposal, num_valid


def drafter_fault(metrics, reqs, where: str) -> None:
    """The drafter raised in `where` for these requests: they continue without drafter context."""
    log.exception("drafter %s failed for %d request(s); they continue with plain decoding", where,
                  len(reqs))
    for r in reqs:
        r.model_drafting = False  # as if admitted without drafter context
        r.take_pending_context()
    with metrics.lock:
        metrics.num_draft_faults += len(reqs)
