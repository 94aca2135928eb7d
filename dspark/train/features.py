"""Target features for drafter training, computed online by the same `models/` code that serves.

One call runs the frozen target over a right-padded batch (only the real tokens, as one flat
variable-length batch through a scratch paged KV pool: one kv_block per sequence) and returns the
residual-stream taps the drafter reads and the final-normed hidden state. Target logits are then
computed only at the rows a loss needs (`target_rows`), in chunks, as the target's logits on the draft
vocabulary plus the full-vocabulary logsumexp (see losses.py for why that pair is enough).

    feats = target_features(target, input_ids=b.input_ids, lengths=b.lengths, tap_layer_ids=(1, 8, 15))
    rows = target_rows(target, feats.hidden, row_mask=valid, d2t=d2t)
    logits, lse = rows.gather(positions)          # positions [batch, ...] → [batch, ..., draft_vocab]

Optional on-disk cache (`FeatureCache`, for small sets): taps and hidden per sample as fp16
safetensors, keyed by the sample key and the tap layers; a cached batch skips the target forward.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.models.attention import SeqSpec, build_attn_metadata


@dataclass(frozen=True)
class TargetFeatures:
    taps: torch.Tensor  # [batch, seq_len, num_taps * hidden] (zero on padding)
    hidden: torch.Tensor  # [batch, seq_len, hidden] final-normed last hidden state (zero on padding)


@dataclass(frozen=True)
class TargetRows:
    """Target logits at a subset of rows: draft-vocab logits and the full-vocab logsumexp."""

    logits: torch.Tensor  # [num_rows, draft_vocab] float32
    lse: torch.Tensor  # [num_rows] float32
    index: torch.Tensor  # [batch, seq_len] long: row of each position in `logits`, -1 = not computed

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [batch, ...] (must be computed rows wherever they are used) → logits
        [batch, ..., draft_vocab], lse [batch, ...]; uncomputed positions give row 0 (mask them)."""
        batch, seq_len = self.index.shape
        if self.logits.shape[0] == 0:  # no row was needed: everything here is masked out
            return (torch.zeros(*positions.shape, self.logits.shape[1]), torch.zeros(positions.shape))
        flat = positions.clamp(0, seq_len - 1).reshape(batch, -1)
        rows = torch.gather(self.index, 1, flat).clamp(min=0)  # [batch, n]
        logits = self.logits[rows.flatten()].view(*positions.shape, -1)
        return logits, self.lse[rows.flatten()].view(positions.shape)


@torch.no_grad()
def target_features(
    target,  # models/ causal LM: forward(input_ids, positions, attn_meta, kv_caches, tap_layer_ids)
    *,
    input_ids: torch.Tensor,  # [batch, seq_len] long, right-padded
    lengths: torch.Tensor,  # [batch] long
    tap_layer_ids: tuple[int, ...],
) -> TargetFeatures:
    batch, seq_len = input_ids.shape
    cfg = target.config
    param = next(target.parameters())
    dtype, device = param.dtype, param.device
    lens = [int(n) for n in lengths]
    valid = torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)  # [batch, seq_len]
    flat_ids = input_ids[valid].to(device)  # [num_tokens]
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)  # [num_tokens]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    seqs = [SeqSpec(block_table=[i], num_cached=0, num_query=n, token_offset=offsets[i])
            for i, n in enumerate(lens)]
    meta = build_attn_metadata(seqs, num_tokens=offsets[-1], kv_block_size=seq_len, device=device)
    kv_heads, head_dim = target.kv_spec
    kv_caches = [(torch.empty(batch, seq_len, kv_heads, head_dim, dtype=dtype, device=device),
                  torch.empty(batch, seq_len, kv_heads, head_dim, dtype=dtype, device=device))
                 for _ in range(target.num_kv_layers)]
    hidden, taps = target(flat_ids, positions, meta, kv_caches, tap_layer_ids=tuple(tap_layer_ids))
    out_taps = torch.zeros(batch, seq_len, taps.shape[-1], dtype=taps.dtype)
    out_hidden = torch.zeros(batch, seq_len, cfg.hidden_size, dtype=hidden.dtype)
    out_taps[valid] = taps.cpu()
    out_hidden[valid] = hidden.cpu()
    return TargetFeatures(taps=out_taps, hidden=out_hidden)


@torch.no_grad()
def target_rows(
    target,
    hidden: torch.Tensor,  # [batch, seq_len, hidden] final-normed
    *,
    row_mask: torch.Tensor,  # [batch, seq_len] bool: rows whose logits a loss needs
    d2t: torch.Tensor | None,  # [draft_vocab] long target ids, None = the full vocabulary
    chunk: int = 256,
) -> TargetRows:
    rows = hidden[row_mask]  # [num_rows, hidden]
    index = torch.full(row_mask.shape, -1, dtype=torch.long)
    index[row_mask] = torch.arange(rows.shape[0])
    draft_vocab = target.config.vocab_size if d2t is None else d2t.numel()
    logits = torch.empty(rows.shape[0], draft_vocab)
    lse = torch.empty(rows.shape[0])
    param = next(target.parameters())
    for s in range(0, rows.shape[0], chunk):
        full = target.compute_logits(rows[s:s + chunk].to(param.device, param.dtype)).float().cpu()
        lse[s:s + chunk] = torch.logsumexp(full, dim=-1)
        logits[s:s + chunk] = full if d2t is None else full[:, d2t]
    return TargetRows(logits=logits, lse=lse, index=index)


class FeatureCache:
    """fp16 taps + hidden per sample under `root`; the file name hashes the key and the tap layers."""

    def __init__(self, root: str | Path, *, tap_layer_ids: tuple[int, ...]):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.tag = ",".join(str(i) for i in tap_layer_ids)

    def _path(self, key: str) -> Path:
        return self.root / f"{hashlib.sha1(f'{key}|{self.tag}'.encode()).hexdigest()[:20]}.safetensors"

    def get(self, keys: list[str], lengths: torch.Tensor) -> TargetFeatures | None:
        paths = [self._path(k) for k in keys]
        if not all(p.exists() for p in paths):
            return None
        items = [load_file(str(p)) for p in paths]
        seq_len = int(lengths.max())
        taps = torch.zeros(len(keys), seq_len, items[0]["taps"].shape[-1])
        hidden = torch.zeros(len(keys), seq_len, items[0]["hidden"].shape[-1])
        for i, t in enumerate(items):
            n = t["taps"].shape[0]
            taps[i, :n], hidden[i, :n] = t["taps"].float(), t["hidden"].float()
        return TargetFeatures(taps=taps, hidden=hidden)

    def put(self, keys: list[str], lengths: torch.Tensor, feats: TargetFeatures) -> None:
        for i, key in enumerate(keys):
            n = int(lengths[i])
            path = self._path(key)
            if not path.exists():
                tmp = path.with_suffix(".tmp")
                save_file({"taps": feats.taps[i, :n].half().contiguous(),
                           "hidden": feats.hidden[i, :n].half().contiguous()}, str(tmp))
                tmp.rename(path)


def batch_features(target, *, batch, tap_layer_ids: tuple[int, ...],
                   cache: FeatureCache | None = None) -> TargetFeatures:
    """Features of a data.Batch, through the cache when one is given."""
    if cache is not None:
        hit = cache.get(batch.keys, batch.lengths)
        if hit is not None:
            return hit
    feats = target_features(target, input_ids=batch.input_ids, lengths=batch.lengths,
                            tap_layer_ids=tap_layer_ids)
    if cache is not None:
        cache.put(batch.keys, batch.lengths, feats)
        return cache.get(batch.keys, batch.lengths)  # train on what a later epoch will read back
    return feats
