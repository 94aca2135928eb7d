"""Training losses for the block drafters (DSpark, DFlash) and EAGLE-3 (reference §4.4).

DSpark, per block b and slot k with weight w = eval_mask · exp(-k / decay) (decay 4.0):
    CE   = Σ w·CE(L_k, y_k) / Σ w                      (data token y_k; out-of-draft-vocab labels skipped)
    L1   = Σ w·‖p_d,k − p_t,k‖₁ / Σ w                  (full L1 in [0, 2], not halved)
    BCE  = Σ w·BCE(c_k, c*_k) / Σ w,   c*_k = clamp(1 − ½‖p_d,k − p_t,k‖₁, 0, 1), detached
    SCE  = Σ w·(−Σ_v p_t,k(v) log p_d,k(v)) / Σ w      (soft CE against the target; optional, weight 0 by default)
    loss = 0.1·CE + 0.9·L1 + 1.0·BCE (+ soft_ce·SCE)    (DFlash: 1.0·CE only, no confidence head)
p_d = softmax(Markov-corrected draft logits), p_t = softmax(target logits), both at T=1 in fp32.

Reduced draft vocabulary: the drafter only scores the V_d tokens of its d2t map. We do NOT renormalise
the target: p_t keeps its full-vocab probabilities on the V_d tokens, and the mass m_out it puts outside
V_d is added to the L1 distance as a constant. ‖p_d − p_t‖₁ is then the exact full-vocab distance (p_d is
zero outside V_d), so c*_k = 1 − ½‖·‖₁ is the true acceptance probability of rejection sampling with this
drafter — the number the confidence head must predict. m_out has no gradient, so it does not change the
L1 optimum for p_d (which is p_t on V_d, as close as a normalised p_d can get).

EAGLE-3, per TTT step j: soft cross-entropy −Σ_v p_t(v) log p_d(v) against the target distribution at
the row that step predicts, masked to assistant tokens, weighted by step_decay**j (0.8) and summed.

Distributed: numerators are local, denominators pass through `all_reduce` (a global sum), so summing
(not averaging) gradients over ranks gives exactly the single-process gradient of the global batch.

    out = dspark_loss(draft_logits=..., confidence_logits=..., labels=..., eval_mask=...,
                      target_logits=..., target_lse=..., weights=LossWeights())
    out.loss.backward(); summarise(out.stats)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    soft_ce: float = 0.0  # soft CE against the target distribution on the draft vocab (EAGLE-3's objective)
    decay: float = 4.0  # position weight exp(-k / decay), k 0-based; <= 0 turns the decay off


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # scalar: what to backward
    stats: dict[str, torch.Tensor]  # detached sums and counts; add across steps/ranks, then summarise()


def position_weights(eval_mask: torch.Tensor, *, decay: float) -> torch.Tensor:
    """[batch, num_anchors, block_size] bool → float weights eval_mask · exp(-k / decay)."""
    block_size = eval_mask.shape[-1]
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-k / decay) if decay > 0 else torch.ones(block_size)
    return eval_mask.float() * w


def target_probs_in_vocab(
    target_logits: torch.Tensor,  # [..., draft_vocab] target logits of the draft-vocab tokens
    target_lse: torch.Tensor,  # [...] logsumexp of the target logits over the FULL vocab
) -> tuple[torch.Tensor, torch.Tensor]:  # p_t on the draft vocab [..., draft_vocab], mass outside [...]
    p_t = torch.exp(target_logits.float() - target_lse.float().unsqueeze(-1))
    return p_t, (1.0 - p_t.sum(-1)).clamp(min=0.0)


def dspark_loss(
    *,
    draft_logits: torch.Tensor,  # [batch, num_anchors, block_size, draft_vocab] Markov-corrected
    confidence_logits: torch.Tensor | None,  # [batch, num_anchors, block_size] or None (DFlash)
    labels: torch.Tensor,  # [batch, num_anchors, block_size] draft-vocab ids, -100 = no CE
    eval_mask: torch.Tensor,  # [batch, num_anchors, block_size] bool, supervised slots
    target_logits: torch.Tensor | None,  # [batch, num_anchors, block_size, draft_vocab]; None: CE only
    target_lse: torch.Tensor | None,  # [batch, num_anchors, block_size]
    weights: LossWeights,
    all_reduce: Reduce = _identity,
) -> LossOutput:
    w = position_weights(eval_mask, decay=weights.decay)  # [batch, num_anchors, block_size]
    has_label = labels >= 0
    w_ce = w * has_label
    den = all_reduce(torch.stack([w.sum(), w_ce.sum()]).detach()).clamp(min=1e-6)
    logits = draft_logits.float()
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten().clamp(min=0), reduction="none")
    ce = ce.view_as(w)  # [batch, num_anchors, block_size]
    ce_mean = (ce * w_ce).sum() / den[1]
    loss = weights.ce * ce_mean
    stats = {"ce_num": (ce * w_ce).sum().detach(), "ce_den": w_ce.sum().detach(), "w_den": w.sum().detach()}

    argmax_match = (logits.argmax(-1) == labels) & eval_mask  # top-1 agreement with the data token
    stats["match"] = argmax_match.float().sum((0, 1))  # [block_size]
    stats["slots"] = eval_mask.float().sum((0, 1))  # [block_size]
    valid_block = eval_mask[..., 0]
    stats["tau_sum"] = (1.0 + argmax_match.int().cumprod(-1).sum(-1).float())[valid_block].sum()
    stats["blocks"] = valid_block.float().sum()

    if target_logits is not None:
        p_t, m_out = target_probs_in_vocab(target_logits, target_lse)
        p_d = torch.softmax(logits, dim=-1)
        l1 = (p_d - p_t).abs().sum(-1) + m_out  # [batch, num_anchors, block_size], in [0, 2]
        l1_mean = (l1 * w).sum() / den[0]
        if weights.l1:
            loss = loss + weights.l1 * l1_mean
        if weights.soft_ce:  # p_t's mass outside the draft vocab is a constant: no term for it
            sce = -(p_t * torch.log_softmax(logits, dim=-1)).sum(-1)  # [batch, num_anchors, block_size]
            sce_num = (sce * w).sum()
            loss = loss + weights.soft_ce * sce_num / den[0]
            stats["sce_num"] = sce_num.detach()
        alpha = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # c*_k: acceptance prob at T=1
        stats["l1_num"] = (l1 * w).sum().detach()
        stats["alpha"] = (alpha * eval_mask).sum((0, 1))  # [block_size]
        if confidence_logits is not None:
            bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), alpha, reduction="none")
            if weights.confidence:
                loss = loss + weights.confidence * (bce * w).sum() / den[0]
            conf = torch.sigmoid(confidence_logits.float()).detach()
            stats["bce_num"] = (bce * w).sum().detach()
            stats["conf_err"] = ((conf - alpha).abs() * eval_mask).sum((0, 1))  # [block_size]
            stats["conf_bias"] = ((conf - alpha) * eval_mask).sum((0, 1))  # [block_size]
    return LossOutput(loss=loss, stats=stats)


def eagle3_step_masks(loss_mask: torch.Tensor, *, num_steps: int, shift: int = 1,
                      row_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per TTT step j, [batch, seq_len - shift - j - 1] bool: row p is scored (token p+shift+j+1 is
    supervised, and row p is in `row_mask` [batch, seq_len] when given)."""
    seq_len = loss_mask.shape[1]
    out = []
    for j in range(num_steps):
        off = shift + j + 1
        m = loss_mask[:, off:].bool() if off < seq_len else loss_mask[:, :0].bool()
        out.append(m if row_mask is None else m & row_mask[:, :m.shape[1]].bool())
    return out


def eagle3_loss(
    *,
    step_logits: list[torch.Tensor],  # per TTT step j: [batch, seq_len, draft_vocab]; row p predicts p+1+shift+j
    # (or already the scored rows only: [num_rows_j, draft_vocab] in the order of `eagle3_step_masks`)
    labels: torch.Tensor,  # [batch, seq_len] draft-vocab id of the token at each position, -100 = out of vocab
    loss_mask: torch.Tensor,  # [batch, seq_len] 0/1 assistant tokens (already 0 on padding)
    target_logits: torch.Tensor,  # [batch, seq_len, draft_vocab]: target logits at row r predict token r+1
    target_lse: torch.Tensor,  # [batch, seq_len]
    step_decay: float = 0.8,
    shift: int = 1,  # EAGLE-3 pairs tap p with token p+1, so step 0 at row p predicts token p+2
    row_mask: torch.Tensor | None = None,  # [batch, seq_len]: score only these rows (None: every row)
    all_reduce: Reduce = _identity,
) -> LossOutput:
    """Only the supervised rows of each step are scored (gathered before the softmax), so memory
    grows with the assistant tokens, not with prompt length times vocabulary."""
    masks = eagle3_step_masks(loss_mask, num_steps=len(step_logits), shift=shift, row_mask=row_mask)
    den = all_reduce(torch.stack([m.sum() for m in masks]).float()).clamp(min=1e-6)
    loss = torch.zeros(())
    match, slots, soft = [], [], []
    for j, logits in enumerate(step_logits):
        off, m = shift + j, masks[j]
        n = m.shape[1]
        rows = logits if logits.dim() == 2 else logits[:, :n][m]  # [num_rows, draft_vocab]
        logp = torch.log_softmax(rows.float(), dim=-1)  # [num_rows, draft_vocab]
        p_t = torch.exp(target_logits[:, off:off + n][m].float() - target_lse[:, off:off + n][m].unsqueeze(-1))
        sce = -(p_t * logp).sum(-1)  # [num_rows]
        loss = loss + (step_decay ** j) * sce.sum() / den[j]
        match.append((logp.argmax(-1) == labels[:, off + 1:][m]).float().sum())
        slots.append(m.float().sum())
        soft.append(sce.sum().detach())
    stats = {"soft_ce_num": torch.stack(soft), "match": torch.stack(match), "slots": torch.stack(slots)}
    return LossOutput(loss=loss, stats=stats)


def add_stats(acc: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for k, v in new.items():
        acc[k] = acc[k] + v.detach() if k in acc else v.detach().clone()
    return acc


def summarise(stats: dict[str, torch.Tensor]) -> dict[str, float | list[float]]:
    """Sums → means: loss terms, per-position top-1 agreement (acc), expected acceptance (alpha), tau."""
    out: dict[str, float | list[float]] = {}
    slots = stats["slots"].clamp(min=1)

    def r(x: torch.Tensor) -> list[float]:
        return [round(float(v), 4) for v in x]

    if "ce_num" in stats:
        out["ce"] = float(stats["ce_num"] / stats["ce_den"].clamp(min=1e-6))
    if "l1_num" in stats:
        out["l1"] = float(stats["l1_num"] / stats["w_den"].clamp(min=1e-6))
        out["alpha"] = r(stats["alpha"] / slots)
    if "bce_num" in stats:
        out["bce"] = float(stats["bce_num"] / stats["w_den"].clamp(min=1e-6))
        out["conf_err"] = r(stats["conf_err"] / slots)
        out["conf_bias"] = r(stats["conf_bias"] / slots)
    if "sce_num" in stats:
        out["sce"] = float(stats["sce_num"] / stats["w_den"].clamp(min=1e-6))
    if "soft_ce_num" in stats:
        out["soft_ce"] = r(stats["soft_ce_num"] / slots)
    out["acc"] = r(stats["match"] / slots)
    if "tau_sum" in stats:
        out["tau_top1"] = float(stats["tau_sum"] / stats["blocks"].clamp(min=1))
    else:  # EAGLE-3: chain of per-step agreement rates (steps are not aligned blocks)
        out["tau_top1"] = 1.0 + float(torch.cumprod(stats["match"] / slots, 0).sum())
    if not math.isfinite(out.get("ce", 0.0)):
        raise FloatingPointError(f"non-finite loss term: {out}")
    return out
