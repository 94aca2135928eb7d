"""Fault isolation inside a step: one request's bad numbers never take the engine down and never reach an
index or a sampler.

- Target logits: a request whose logits rows hold NaN or +inf (or a row that is -inf throughout) is
  failed loudly: its rows are zeroed so the step can verify the others, nothing it committed in this
  step is emitted, and it ends with reason "abort" and a message in `Engine.failed` (the server's
  500, the offline API's RuntimeError). (-inf entries alone are masks, not faults.)
- A drafter's faults: dspark/speculation/faults.py.
"""

from __future__ import annotations

import logging

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
