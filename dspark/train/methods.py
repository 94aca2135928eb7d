"""Per-method pieces of drafter training: build the drafter from the target, compute one batch's loss,
export a checkpoint. The trainer loop (trainer.py) is the same for every method.

    dspark  DSparkModel with a Markov head + confidence head; loss 0.1 CE + 0.9 L1 + 1.0 BCE, exp(-k/4)
    dflash  the same network with markov_rank 0 and no confidence head; CE with exp(-k/4) (reference §3.4)
    eagle3  one fused-taps decoder layer unrolled for ttt_steps; per-step soft CE, weights 0.8**j

The drafter's embedding and LM head are the target's (frozen; for a reduced draft vocab the LM head is
the target's d2t rows). Every other parameter is re-initialised N(0, init_std) (norms 1, biases 0) from
the config seed, so a run is reproducible; the final norm starts as the target's final norm.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dspark.train.anchors import (block_eval_mask, block_positions, process_anchors, process_rounds,
                                  sample_anchors, valid_anchor_mask)
from dspark.train.data import Batch, t2d_labels
from dspark.train.features import TargetFeatures, target_rows
from dspark.train.losses import LossOutput, LossWeights, dspark_loss, eagle3_loss

METHODS = ("dspark", "dflash", "eagle3")


def init_trainable(model: nn.Module, *, std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            owner = name.rsplit(".", 1)[0].split(".")[-1]  # e.g. input_layernorm, q_norm, proj
            if "norm" in owner:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def copy_final_norm(model: nn.Module, target) -> None:
    """Start the drafter's final norm at the target's: the frozen LM head then sees hidden states on the
    scale it was trained for (a unit norm makes the first logits far too sharp for SmolLM2's head). The
    factor the target's norm applies: its `scale` where it keeps one (Gemma's 1 + weight), else its weight."""
    norm = target.model.norm
    with torch.no_grad():
        model.norm.weight.copy_(getattr(norm, "scale", norm.weight).to(model.norm.weight.dtype))


def target_embed_and_head(target) -> tuple[torch.Tensor, torch.Tensor]:
    return target.model.embed_tokens.dense_weight(), target.lm_head.dense_weight()


# -- DSpark / DFlash -----------------------------------------------------------------------------------

def build_block_drafter(cfg, target, target_cfg, d2t: torch.Tensor | None):
    from dspark.drafters.dspark_config import dspark_config_for_target
    from dspark.drafters.dspark_model import DSparkModel
    is_dspark = cfg.method == "dspark"
    dcfg = dspark_config_for_target(
        target_cfg, num_hidden_layers=cfg.num_draft_layers, block_size=cfg.block_size,
        tap_layer_ids=cfg.tap_layer_ids, markov_rank=cfg.markov_rank if is_dspark else 0,
        markov_head_type=cfg.markov_head_type, enable_confidence_head=is_dspark,
        draft_vocab_size=None if d2t is None else d2t.numel(), anchor_features=cfg.anchor_features)
    model = DSparkModel(dcfg)
    if d2t is not None:
        model.reset_buffers(d2t=d2t)
    embed, head = target_embed_and_head(target)
    model.share_target_weights(embed_weight=embed, lm_head_weight=head)
    init_trainable(model, std=cfg.init_std, seed=cfg.seed)
    if model.anchor_proj is not None:
        model.anchor_proj.weight.data.zero_()  # at first the drafter without it
    copy_final_norm(model, target)
    if cfg.warm_start == "target":
        from dspark.train.warm_start import warm_start_from_target
        warm_start_from_target(model, target, layer_ids=cfg.warm_start_layers)
    return model, dcfg


def block_loss(cfg, model, target, batch: Batch, feats: TargetFeatures, *, d2t: torch.Tensor | None,
               seeds: list[int], all_reduce: Callable, head_rows: torch.Tensor | None = None,
               focus: list[torch.Tensor] | None = None) -> LossOutput:
    num_draft = model.cfg.max_draft_tokens
    anchors = sample_anchors(loss_mask=batch.loss_mask, lengths=batch.lengths, num_anchors=cfg.num_anchors,
                             seeds=seeds, focus=focus, focus_frac=cfg.anchor_focus)  # [batch, num_anchors]
    eval_mask = block_eval_mask(loss_mask=batch.loss_mask, lengths=batch.lengths, anchors=anchors,
                                block_size=num_draft)  # [batch, num_anchors, num_draft]
    out = model.training_forward(taps=feats.taps, input_ids=batch.input_ids, anchor_positions=anchors)
    labels = torch.where(eval_mask, out.labels, torch.full_like(out.labels, -100))
    weights = LossWeights(ce=cfg.loss_ce, l1=cfg.loss_l1, confidence=cfg.loss_confidence, soft_ce=cfg.loss_soft_ce,
                          decay=cfg.loss_decay)
    target_logits = target_lse = None
    if cfg.loss_l1 or cfg.loss_confidence or cfg.loss_soft_ce or out.confidence_logits is not None:
        pos = block_positions(anchors=anchors, block_size=num_draft)  # output k predicts pos+1
        rows_needed = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
        rows_needed[torch.arange(pos.shape[0]).view(-1, 1, 1).expand_as(pos)[eval_mask], pos[eval_mask]] = True
        rows = target_rows(target, feats.hidden, row_mask=rows_needed, d2t=d2t, lse=feats.lse,
                           head_rows=head_rows)
        target_logits, target_lse = rows.gather(pos)
    return dspark_loss(draft_logits=out.draft_logits, confidence_logits=out.confidence_logits, labels=labels,
                       eval_mask=eval_mask, target_logits=target_logits, target_lse=target_lse,
                       weights=weights, all_reduce=all_reduce)


@torch.no_grad()
def block_accepted(model, batch: Batch, feats: TargetFeatures, *, chunk: int = 64) -> torch.Tensor:
    """[batch, seq_len] long: for the block anchored at every position, how many of its drafts greedy
    verification keeps (leading slots whose top-1, Markov head teacher-forced, is the data token; 0 where
    the position cannot anchor). Anchors go through `training_forward` `chunk` per sequence at a time."""
    num_draft = model.cfg.max_draft_tokens
    valid = valid_anchor_mask(loss_mask=batch.loss_mask, lengths=batch.lengths)  # [batch, seq_len]
    accepted = torch.zeros(valid.shape, dtype=torch.long)
    for start in range(0, valid.shape[1], chunk):
        pos = torch.arange(start, min(start + chunk, valid.shape[1]))  # [n]
        anchors = torch.where(valid[:, pos], pos, -1)  # [batch, n]
        if not bool((anchors >= 0).any()):
            continue
        eval_mask = block_eval_mask(loss_mask=batch.loss_mask, lengths=batch.lengths, anchors=anchors,
                                    block_size=num_draft)  # [batch, n, num_draft]
        out = model.training_forward(taps=feats.taps, input_ids=batch.input_ids, anchor_positions=anchors)
        match = (out.draft_logits.argmax(-1) == out.labels) & eval_mask
        accepted[:, pos] = match.int().cumprod(-1).sum(-1).long()
    return accepted


@torch.no_grad()
def eagle3_accepted(model, batch: Batch, feats: TargetFeatures, *, d2t: torch.Tensor | None, ttt_steps: int,
                    chunk: int = 64) -> torch.Tensor:
    """`block_accepted` for EAGLE-3: the drafts after the token at position a come from the TTT chain of row
    a - 1 (step j predicts token a + j + 1, teacher-forced); chains go through `training_forward_chains`
    `chunk` per sequence at a time."""
    valid = valid_anchor_mask(loss_mask=batch.loss_mask, lengths=batch.lengths)  # [batch, seq_len]
    valid[:, 0] = False  # (no row before it)
    batch_size, seq_len = valid.shape
    labels = batch.input_ids if d2t is None else t2d_labels(batch.input_ids, d2t, vocab_size=model.config.vocab_size)
    supervised = batch.loss_mask.bool() & (torch.arange(seq_len).unsqueeze(0) < batch.lengths.unsqueeze(1))
    starts = [row.nonzero().squeeze(1) for row in valid]  # per sequence its anchors a
    accepted = torch.zeros(valid.shape, dtype=torch.long)
    for lo in range(0, max(len(a) for a in starts), chunk):
        anchors = torch.full((batch_size, chunk), -1, dtype=torch.long)  # chain rows a - 1, -1 padding at the end
        for b, a in enumerate(starts):
            part = a[lo:lo + chunk]
            anchors[b, :len(part)] = part - 1
        live = anchors >= 0
        steps = model.training_forward_chains(taps=feats.taps, input_ids=batch.input_ids, anchors=anchors,
                                              ttt_steps=ttt_steps)  # per step [batch, chunk, d]
        keep = live.clone()
        count = torch.zeros(anchors.shape, dtype=torch.long)
        for j, h in enumerate(steps):
            predicts = anchors + j + 2  # [batch, chunk]
            inside = predicts < seq_len
            at = predicts.clamp(0, seq_len - 1)
            guess = model.draft_logits(h.reshape(-1, h.shape[-1])).argmax(-1).view(anchors.shape)
            keep &= inside & supervised.gather(1, at) & (guess == labels.gather(1, at))
            count += keep.long()
        rows = torch.arange(batch_size).unsqueeze(1).expand_as(anchors)
        accepted[rows[live], anchors[live] + 1] = count[live]
    return accepted


def focus_anchors(model, batch: Batch, feats: TargetFeatures) -> tuple[list[torch.Tensor], int]:
    """(per row [num_rounds] long: the anchors greedy decoding with this block drafter visits
    (`anchors.process_anchors`), for `TrainConfig.anchor_focus`; the answer tokens they emit)."""
    feats = _drafter_features(feats)
    valid = valid_anchor_mask(loss_mask=batch.loss_mask, lengths=batch.lengths)
    rounds = process_anchors(accepted=block_accepted(model, batch, feats), valid=valid)
    return [torch.tensor(r, dtype=torch.long) for r in rounds], int(valid.sum())


def process_tau_counts(cfg, model, batch: Batch, feats: TargetFeatures, *, d2t: torch.Tensor | None
                       ) -> tuple[int, int]:
    """(tokens, rounds) of greedy decoding replayed along the batch's answers (`anchors.process_rounds`),
    the accepted drafts per anchor from `block_accepted` or, for EAGLE-3, `eagle3_accepted`."""
    feats = _drafter_features(feats)
    if cfg.method == "eagle3":
        accepted = eagle3_accepted(model, batch, feats, d2t=d2t, ttt_steps=cfg.ttt_steps)
    else:
        accepted = block_accepted(model, batch, feats)
    return process_rounds(accepted=accepted, valid=valid_anchor_mask(loss_mask=batch.loss_mask, lengths=batch.lengths))


def export_block_drafter(model, dcfg, path: str | Path, *, max_shard_bytes: int | None = None) -> None:
    from dspark.drafters.dspark import save_dspark
    save_dspark(model, dcfg, path, max_shard_bytes=max_shard_bytes)


# -- EAGLE-3 ---------------------------------------------------------------------------------------------

def build_eagle3(cfg, target, target_cfg, d2t: torch.Tensor | None):
    """EAGLE-3 over the target vocabulary, or over a reduced draft vocabulary `d2t` (the head is then the
    target's rows d2t, frozen, as for the block drafters)."""
    from dspark.drafters.eagle3 import bind_to_target
    from dspark.drafters.eagle3_model import Eagle3Config, Eagle3Model
    ecfg = Eagle3Config.from_target(target_cfg, tap_layer_ids=cfg.tap_layer_ids, num_draft_tokens=cfg.ttt_steps,
                                    draft_vocab_size=None if d2t is None else d2t.numel())
    model = Eagle3Model(ecfg).requires_grad_(True)  # target-family modules are built frozen
    if d2t is not None:
        model.d2t = d2t.clone()
    model.init_weights(std=cfg.init_std, seed=cfg.seed)
    copy_final_norm(model, target)
    bind_to_target(model, target)
    return model, ecfg


def eagle3_batch_loss(cfg, model, target, batch: Batch, feats: TargetFeatures, *, d2t: torch.Tensor | None,
                      seeds: list[int], all_reduce: Callable, head_rows: torch.Tensor | None = None,
                      focus: list[torch.Tensor] | None = None) -> LossOutput:
    assert focus is None, "anchor_focus is for the block drafters"
    valid = torch.arange(batch.input_ids.shape[1]).unsqueeze(0) < batch.lengths.unsqueeze(1)
    # up to `num_anchors` random rows per sequence start a TTT chain (as many chains as DSpark has
    # blocks, so the methods spend the same head and backward budget per step)
    anchors = sample_anchors(loss_mask=batch.loss_mask, lengths=batch.lengths, num_anchors=cfg.num_anchors,
                             seeds=seeds)  # [batch, C] ascending, -1 = none
    keep = anchors >= 0
    bidx = torch.arange(anchors.shape[0]).unsqueeze(1).expand_as(anchors)
    scored = torch.zeros_like(valid)
    scored[bidx[keep], anchors[keep]] = True
    step_hidden = model.training_forward_chains(taps=feats.taps, input_ids=batch.input_ids, anchors=anchors,
                                                ttt_steps=cfg.ttt_steps)  # per step [batch, C, d]
    supervised = batch.loss_mask.bool() & valid  # [batch, seq_len]
    step_logits = []  # the draft head only on scored rows, row-major (the order eagle3_loss gathers in)
    for j, h in enumerate(step_hidden):
        predicts = anchors + j + 2  # [batch, C] the token step j of each chain predicts
        inside = keep & (predicts < supervised.shape[1])
        use = inside & supervised.gather(1, predicts.clamp(0, supervised.shape[1] - 1))
        step_logits.append(model.draft_logits(h[use]))  # [num_scored_j, draft_vocab]
    rows_needed = torch.zeros_like(valid)
    rows_needed[:, :-1] = batch.loss_mask[:, 1:].bool()  # target row r predicts token r+1
    rows = target_rows(target, feats.hidden, row_mask=rows_needed & valid, d2t=d2t, lse=feats.lse,
                       head_rows=head_rows)
    logits, lse = rows.gather(torch.arange(valid.shape[1]).expand_as(valid).contiguous())
    vocab = target.config.vocab_size
    labels = batch.input_ids if d2t is None else t2d_labels(batch.input_ids, d2t, vocab_size=vocab)
    return eagle3_loss(step_logits=step_logits, labels=labels, loss_mask=batch.loss_mask * valid, row_mask=scored,
                       target_logits=logits, target_lse=lse, step_decay=cfg.step_loss_decay,
                       shift=1, all_reduce=all_reduce)  # step j at row p predicts token p+j+2


def export_eagle3(model, ecfg, path: str | Path, *, max_shard_bytes: int | None = None) -> None:
    """bf16 weights, like the block drafters' exports (loading casts to the serving dtype)."""
    from dspark.drafters.eagle3_model import save_eagle3
    save_eagle3(model, ecfg, str(path), dtype=torch.bfloat16, max_shard_bytes=max_shard_bytes)


def load_export(cfg, path: str | Path, target) -> nn.Module:
    """An exported drafter of cfg.method in fp32 (a warm start for `init_from`)."""
    if not Path(path, "config.json").is_file():
        raise ValueError(f"init_from {str(path)!r}: no config.json (expected an exported drafter folder)")
    if cfg.method == "eagle3":
        from dspark.drafters.eagle3_model import load_eagle3
        return load_eagle3(str(path))
    from dspark.drafters.dspark import load_dspark
    model, _ = load_dspark(path, target_model=target)
    return model


# a grown layer's projections into the residual stream: zero at step 0, so the layer adds nothing yet
GROWN_ZERO = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
# a grown Markov rank (vanilla head): the source's columns first; the new ones of W1 keep their random start, those
# of W2 and of the confidence head's W1[prev] input start at zero (no bias, no confidence change yet)
RANK_GROWN = {"markov_head.markov_w1.weight": False, "markov_head.markov_w2.weight": True,
              "confidence_head.proj.weight": True}


def copy_trainable(source: nn.Module, model: nn.Module, *, where: str, grow: bool = False) -> None:
    """Every trainable parameter of `model` from the same-named one of `source` (shapes must agree; a
    missing or mis-shaped tensor is a ValueError naming it: the warm start must be the same drafter).
    grow: a block drafter larger than `source` in two ways. Extra layers (appended after source's, before
    the final norm) start as copies of source's last layer with o_proj and down_proj at zero: each adds
    nothing to the residual stream. A larger rank of the vanilla Markov head keeps source's columns first
    (RANK_GROWN). Either way the grown drafter drafts what `source` does until training moves those zeros."""
    have = dict(source.named_parameters())
    grown = _grown_layer_names(source, model, where=where) if grow else {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if name in grown:
                src_name, zero = grown[name]
                p.copy_(torch.zeros_like(p) if zero else have[src_name].to(p.dtype))
                continue
            src = have.get(name)
            if grow and name == "anchor_proj.weight" and src is None:  # added to the export: starts at zero
                p.zero_()
                continue
            if grow and name in RANK_GROWN and src is not None and _widens(src, p, model):
                if RANK_GROWN[name]:
                    p.zero_()
                p[:, :src.shape[1]] = src.to(p.dtype)
                continue
            if src is None or src.shape != p.shape:
                got = "missing" if src is None else f"shape {list(src.shape)}"
                raise ValueError(f"init_from {where!r}: {name} is {got}, the config's drafter needs {list(p.shape)}")
            p.copy_(src.to(p.dtype))


def _widens(src: torch.Tensor, p: torch.Tensor, model: nn.Module) -> bool:
    """Whether p [rows, cols] is src with more columns, on a vanilla Markov head (the gated and RNN heads have
    rank-shaped state of their own)."""
    from dspark.drafters.heads import MarkovHead
    return (type(getattr(model, "markov_head", None)) is MarkovHead and src.dim() == p.dim() == 2
            and src.shape[0] == p.shape[0] and src.shape[1] < p.shape[1])


def _grown_layer_names(source: nn.Module, model: nn.Module, *, where: str) -> dict[str, tuple[str, bool]]:
    """{model parameter of a layer past source's: (source's last-layer parameter it copies, zeroed?)}."""
    src_depth, depth_now = len(source.layers), len(model.layers)
    if not 0 < src_depth <= depth_now:
        raise ValueError(f"init_from {where!r}: {src_depth} draft layers; growing needs 1 .. {depth_now}")
    out = {}
    for name, _ in model.named_parameters():
        m = re.match(r"layers\.(\d+)\.(.+)", name)
        if m and int(m.group(1)) >= src_depth:
            out[name] = (f"layers.{src_depth - 1}.{m.group(2)}", m.group(2) in GROWN_ZERO)
    return out


def build(cfg, target, target_cfg, d2t):
    return (build_eagle3 if cfg.method == "eagle3" else build_block_drafter)(cfg, target, target_cfg, d2t)


def _drafter_features(feats: TargetFeatures) -> TargetFeatures:
    """Taps in fp32 for an fp32 drafter (no bf16 autocast); as they are otherwise."""
    if feats.taps.dtype != torch.float32 and not torch.is_autocast_enabled("cpu"):
        return TargetFeatures(taps=feats.taps.float(), hidden=feats.hidden, lse=feats.lse)
    return feats


def batch_loss(cfg, model, target, batch, feats, **kwargs) -> LossOutput:
    args = (model, target, batch, _drafter_features(feats))
    return (eagle3_batch_loss if cfg.method == "eagle3" else block_loss)(cfg, *args, **kwargs)


def export(cfg, model, dcfg, path) -> None:
    shard = None if cfg.export_shard_mb is None else int(cfg.export_shard_mb * 2 ** 20)
    (export_eagle3 if cfg.method == "eagle3" else export_block_drafter)(model, dcfg, path, max_shard_bytes=shard)
