"""The vocabulary-parallel head's argmax: a greedy-only step (`dspark.verify.sampler.argmax_suffices`) needs
each logits row's argmax, not the row, so every rank reduces its slice of the vocabulary to one
(maximum, global index) pair per row and rank 0 gathers those [num_logits, 2] pairs instead of the
[num_logits, V / size] slices, then keeps each row's winner.

Tie rule, the same as `torch.argmax` over the whole row (and `dspark.sampling.greedy_ids`): the lowest
index among the row's maxima. Within a slice the reduction gives the first maximum; across slices the merge
keeps, among the slices whose maximum equals the row's, the lowest global index (the slices are contiguous
ranges in rank order, so that is the first maximum of the whole row). The padding rows of the last slice
(its weight rows past V are zeros, logit 0) are left out of its reduction, so they never win. A NaN in any
slice makes the row's value NaN (and its index that slice's NaN): the fault check fails that request as
it would from the gathered row; +inf and a row masked throughout to -inf carry over likewise.

The pair travels as float32: the maximum as computed, the index exactly (below 2**24; every vocabulary
dspark loads is far smaller).
"""

from __future__ import annotations

import torch

from dspark.sampling import RowArgmax

MAX_EXACT_INDEX = 2**24  # float32 holds every integer below it exactly


def slice_winners(local: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """local [num_logits, per] float32 (this rank's vocabulary rows [start, start + per), the last rank's
    padded past `vocab_size`) -> [num_logits, 2] float32: each row's maximum over the real rows and its
    global index (the first on ties)."""
    if vocab_size > MAX_EXACT_INDEX:
        raise ValueError(f"vocabulary of {vocab_size} tokens: float32 cannot carry its indices exactly")
    real = max(0, min(local.shape[1], vocab_size - start))
    if real == 0:  # a slice wholly padding (more ranks than tokens): a -inf that loses to every real slice
        return torch.stack([torch.full((local.shape[0],), float("-inf"), device=local.device),
                            torch.full((local.shape[0],), float(start), device=local.device)], dim=1)
    part = local[:, :real]  # [num_logits, real]: a view, the padding left out
    top = part.max(dim=-1)  # greedy_ids' reduction: the first maximum of the slice
    return torch.stack([top.values.float(), (top.indices + start).float()], dim=1)


def merge_winners(parts: torch.Tensor) -> RowArgmax:
    """parts [num_logits, size, 2] (rank r's `slice_winners` at [:, r]) -> the rows' `RowArgmax`: the
    greatest maximum; on ties between slices, the lowest index."""
    values, index = parts[..., 0], parts[..., 1]  # [num_logits, size] each
    best = values.max(dim=-1).values  # [num_logits]: NaN when any slice's is
    hit = (values == best.unsqueeze(1)) | values.isnan()  # the slices that hold the row's maximum (or a NaN)
    winner = torch.where(hit, index, torch.full_like(index, float("inf"))).min(dim=-1).values
    return RowArgmax(best, winner.long())


def gather_argmax(tp, local: torch.Tensor, start: int, vocab_size: int) -> RowArgmax | None:
    """Every rank: its slice's winners, gathered to rank 0 -> the merged `RowArgmax` there, None elsewhere.
    `tp` is the rank's `TPGroup`; the payload is [num_logits, 2] float32 per rank."""
    gathered = tp.gather_cat(slice_winners(local, start, vocab_size))  # [num_logits, size * 2] on rank 0
    if gathered is None:
        return None
    return merge_winners(gathered.view(gathered.shape[0], tp.size, 2))
