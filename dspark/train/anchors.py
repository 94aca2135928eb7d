"""Anchors and draft blocks for DSpark / DFlash training (reference §4.3).

A training sequence yields many draft blocks at once: each *anchor* position i starts a block whose γ
slots sit at positions i .. i+γ-1 and predict the tokens at i+1 .. i+γ. This file only picks anchors
and describes the blocks (labels, supervision mask, target rows); the drafter's `training_forward`
builds the block attention mask itself.

    anchors = sample_anchors(loss_mask=batch.loss_mask, lengths=batch.lengths, num_anchors=64,
                             block_size=7, seeds=seeds)         # [batch, num_anchors], -1 = none
    eval_mask = block_eval_mask(loss_mask=..., lengths=..., anchors=anchors, block_size=7)

Choice: an anchor is valid when the token it predicts first (position i+1) is an assistant token and
i+1 is inside the sequence. DeepSpec also asks loss_mask[i], which drops the last prompt token as an
anchor; that anchor is exactly the first drafting round after prefill, so we keep it.
"""

from __future__ import annotations

import torch


def valid_anchor_mask(
    *,
    loss_mask: torch.Tensor,  # [batch, seq_len] 0/1, 1 on assistant tokens
    lengths: torch.Tensor,  # [batch] long, real tokens per row (the rest is padding)
) -> torch.Tensor:  # [batch, seq_len] bool
    """Position i may anchor a block iff i+1 < length and token i+1 is supervised."""
    batch, seq_len = loss_mask.shape
    ok = torch.zeros(batch, seq_len, dtype=torch.bool)
    inside = torch.arange(seq_len).unsqueeze(0) + 1 < lengths.unsqueeze(1)  # [batch, seq_len]
    ok[:, :-1] = loss_mask[:, 1:].bool()
    return ok & inside


def sample_anchors(
    *,
    loss_mask: torch.Tensor,  # [batch, seq_len]
    lengths: torch.Tensor,  # [batch]
    num_anchors: int,
    seeds: list[int],  # one seed per row: anchors of a sequence do not depend on its batch or rank
    focus: list[torch.Tensor] | None = None,  # per row: positions to favour (e.g. `process_anchors`)
    focus_frac: float = 0.0,
) -> torch.Tensor:  # [batch, num_anchors] long, sorted ascending, -1 padding at the end
    """Up to `num_anchors` valid positions per row, without replacement, then sorted: uniformly, or with
    `focus`, round(focus_frac * num_anchors) of them from the row's focus positions first (uniformly among
    those) and the rest uniformly from the other valid positions."""
    valid = valid_anchor_mask(loss_mask=loss_mask, lengths=lengths)
    out = torch.full((valid.shape[0], num_anchors), -1, dtype=torch.long)
    for row, seed in enumerate(seeds):
        cand = valid[row].nonzero().squeeze(1)  # [num_valid]
        gen = torch.Generator().manual_seed(int(seed))
        picked = cand[:0]
        if focus is not None and focus_frac > 0:
            mine = focus[row][valid[row][focus[row]]]  # the anchorable ones only
            picked = mine[torch.randperm(mine.numel(), generator=gen, device=gen.device)[:round(focus_frac * num_anchors)]]
            cand = cand[~torch.isin(cand, picked)]
        if cand.numel() > num_anchors - picked.numel():
            cand = cand[torch.randperm(cand.numel(), generator=gen, device=gen.device)[:num_anchors - picked.numel()]]
        cand = torch.cat([picked, cand]).sort().values
        out[row, :cand.numel()] = cand
    return out


def block_positions(
    *,
    anchors: torch.Tensor,  # [batch, num_anchors], -1 invalid
    block_size: int,
) -> torch.Tensor:  # [batch, num_anchors, block_size] long: position of slot k = anchor + k (invalid → 0)
    pos = anchors.clamp(min=0).unsqueeze(-1) + torch.arange(block_size)
    return torch.where(anchors.unsqueeze(-1) >= 0, pos, torch.zeros_like(pos))


def block_eval_mask(
    *,
    loss_mask: torch.Tensor,  # [batch, seq_len]
    lengths: torch.Tensor,  # [batch]
    anchors: torch.Tensor,  # [batch, num_anchors]
    block_size: int,
) -> torch.Tensor:  # [batch, num_anchors, block_size] bool
    """Slot k of block b is supervised iff the anchor is valid, anchor+k+1 < length and that token is an
    assistant token; then cumulative AND along k, so only a contiguous prefix of a block is trained."""
    seq_len = loss_mask.shape[1]
    label_pos = anchors.unsqueeze(-1) + 1 + torch.arange(block_size)  # [batch, num_anchors, block_size]
    inside = (anchors.unsqueeze(-1) >= 0) & (label_pos < lengths.view(-1, 1, 1))
    gathered = torch.gather(loss_mask.bool(), 1, label_pos.clamp(0, seq_len - 1).flatten(1))
    ok = inside & gathered.view_as(label_pos)
    return ok.int().cumprod(dim=-1).bool()


def block_labels(
    *,
    input_ids: torch.Tensor,  # [batch, seq_len] long
    anchors: torch.Tensor,  # [batch, num_anchors]
    eval_mask: torch.Tensor,  # [batch, num_anchors, block_size] bool
) -> torch.Tensor:  # [batch, num_anchors, block_size] long target-vocab ids, -100 where not supervised
    """y[b, k] = x[anchor_b + k + 1] (the data token slot k predicts)."""
    seq_len = input_ids.shape[1]
    block_size = eval_mask.shape[-1]
    label_pos = (anchors.unsqueeze(-1) + 1 + torch.arange(block_size)).clamp(0, seq_len - 1)
    labels = torch.gather(input_ids, 1, label_pos.flatten(1)).view_as(label_pos)
    return torch.where(eval_mask, labels, torch.full_like(labels, -100))


def process_anchors(
    *,
    accepted: torch.Tensor,  # [batch, seq_len] long: drafts the block anchored at each position keeps (greedy)
    valid: torch.Tensor,  # [batch, seq_len] bool: `valid_anchor_mask`
) -> list[list[int]]:  # per row the anchors of its rounds, in order
    """Greedy speculative decoding replayed along a sequence, as the engine runs it: every contiguous run of
    anchorable positions is one answer; its first round anchors at the run's first position (the prompt's
    last token: the first round after prefill), each round emits its accepted drafts plus the target's
    token, and the next round anchors at the last token emitted (a round near the end emits only what is
    left). Uniform anchors (`tau_top1`) weigh easy stretches as much as hard ones; the process crosses easy
    stretches in few rounds and spends most rounds where drafts fail early."""
    out = []
    for row_valid, row_acc in zip(valid.tolist(), accepted.tolist()):
        rounds, pos, seq_len = [], 0, len(row_valid)
        while pos < seq_len:
            if not row_valid[pos]:
                pos += 1
                continue
            end = pos  # the run of anchors pos .. end; it emits tokens pos+1 .. end+1
            while end + 1 < seq_len and row_valid[end + 1]:
                end += 1
            while pos <= end:
                rounds.append(pos)
                pos += min(row_acc[pos] + 1, end + 1 - pos)
            pos = end + 1
        out.append(rounds)
    return out


def process_rounds(*, accepted: torch.Tensor, valid: torch.Tensor) -> tuple[int, int]:
    """(tokens emitted, rounds) of `process_anchors`: every answer token is emitted once, so the tokens are
    the anchorable positions; their ratio is the τ the engine sees."""
    return int(valid.sum()), sum(len(r) for r in process_anchors(accepted=accepted, valid=valid))
