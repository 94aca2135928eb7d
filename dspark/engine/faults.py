"""Fault isolation inside a step: one request's bad numbers, or a drafter's exception, never take the
engine down and never reach an index or a sampler.

- Target logits: a request whose logits rows hold NaN or +inf (or a row that is -inf throughout) is
  failed loudly: its rows are zeroed so the step can verify the others, nothing it committed in this
  step is emitted, and it ends with reason "abort" and a message in `Engine.failed` (the server's
  500, the offline API's RuntimeError). (-inf entries alone are masks, not faults.)
- Drafts: a proposal row with a draft id outside the vocabulary, a non-finite or out-of-[0, 1]
  confidence, or non-finite / negative / misshapen draft probabilities is dropped: that request
  decodes plainly in the next step (`EngineMetrics.num_draft_faults`). Plain decoding is
  speculation with zero drafts, so greedy output is unchanged.
- A drafter exception (propose or extend_context): the requests of that call lose their drafter
  context (`Request.model_drafting` False, as a request admitted without one) and decode plainly
  from then on; each counts as a draft fault. Prompt lookup (`has_free_drafts`) may still draft.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from dspark.sampling import RowArgmax

log = logging.getLogger(__name__)


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """[num_logits, vocab] → bool [num_logits] of faulty rows, or None when every row is sound (the
    usual case costs one sum over the logits and one sync)."""
    sums = logits.float().sum(dim=-1)  # [num_logits]: NaN or +inf when any entry is
    if bool(torch.isfinite(sums).all()):
        return None
    bad = torch.isnan(sums) | (sums == float("inf"))
    neg = sums == float("-inf")
    if bool(neg.any()):  # -inf masks are fine unless the whole row is masked
        bad |= neg & (logits.float().max(dim=-1).values == float("-inf"))
    return bad if bool(bad.any()) else None


class RequestError(str):
    """A failure message whose cause is the request itself (constraints no token satisfies), not the model or
    the engine: the server answers it with a 400 rather than a 500."""

    status = 400


def isolate_target_faults(items, logits: "torch.Tensor | RowArgmax") -> tuple["torch.Tensor | RowArgmax",
                                                                              dict[str, str]]:
    """For the emitting `items` (ScheduledRequest, rows in order): the logits (or their `RowArgmax`, whose
    row maxima are NaN, +inf or -inf exactly where the rows are faulty) with the rows of requests whose
    logits are faulty zeroed (a copy; the same object when none is), and request_id → message for each
    such request."""
    bad = nonfinite_rows(logits.values.unsqueeze(1) if isinstance(logits, RowArgmax) else logits)
    if bad is None:
        return logits, {}
    logits = logits.clone()  # (an inference tensor may not be written in place)
    failed: dict[str, str] = {}
    row = 0
    for s in items:
        rows = slice(row, row + s.num_logits)
        row += s.num_logits
        if bool(bad[rows].any()):
            logits[rows] = 0.0
            rid = s.request.request_id
            failed[rid] = ("the model produced non-finite logits (NaN/inf) for this request; it was "
                           "stopped rather than sample from them")
            log.error("request %s: non-finite target logits", rid)
    return logits, failed


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


def checked_proposal(engine, reqs, batch):
    """`engine.drafter.propose(batch)` with its faulty rows dropped; (None, []) if it raised."""
    try:
        proposal = engine.drafter.propose(batch)
    except Exception:
        drafter_fault(engine, reqs, "propose")
        return None, []
    num_valid = ([proposal.draft_ids.shape[1]] * len(reqs) if proposal.num_valid is None
                 else list(proposal.num_valid))
    bad = faulty_proposal_rows(proposal, vocab_size=engine.model_config.vocab_size,
                               num_valid=num_valid)
    if bad:
        log.warning("dropped faulty drafts (non-finite or out of range) for %d request(s)", len(bad))
        proposal = drop_rows(proposal, bad, num_valid)
        num_valid = list(proposal.num_valid)
        with engine.metrics.lock:
            engine.metrics.num_draft_faults += len(bad)
    return proposal, num_valid


def drafter_fault(engine, reqs, where: str) -> None:
    """The drafter raised in `where` for these requests: they continue without drafter context."""
    log.exception("drafter %s failed for %d request(s); they continue with plain decoding", where,
                  len(reqs))
    for r in reqs:
        r.clear_drafts()
        r.model_drafting = False  # as if admitted without drafter context
        r.take_pending_context()
    with engine.metrics.lock:
        engine.metrics.num_draft_faults += len(reqs)


def fail_request(engine, request_id: str, message: str, emitted: dict[str, list[int]]) -> None:
    """End a request whose target logits were faulty; what it committed this step is not emitted."""
    req = engine.requests[request_id]
    emitted.pop(request_id, None)
    if req.is_finished:  # it finished in this very commit (length, eos): still a failure
        req.finish_reason = "abort"
    else:
        engine.scheduler.finish_request(req, "abort")
    engine.failed[request_id] = message
    engine.metrics.num_failed_requests += 1
