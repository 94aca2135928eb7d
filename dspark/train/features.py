"""Target features for drafter training, computed online by the same `models/` code that serves.

One call runs the frozen target over a right-padded batch (only the real tokens, as one flat
variable-length batch through a scratch paged KV pool: one kv_block per sequence) and returns the
residual-stream taps the drafter reads and the final-normed hidden state. Target logits are then
computed only at the rows a loss needs (`target_rows`), in chunks, as the target's logits on the draft
vocabulary plus the full-vocabulary logsumexp (see losses.py for why that pair is enough).

    feats = target_features(target, input_ids=b.input_ids, lengths=b.lengths, tap_layer_ids=(1, 8, 15))
    rows = target_rows(target, feats.hidden, row_mask=valid, d2t=d2t)
    logits, lse = rows.gather(positions)          # positions [batch, ...] → [batch, ..., draft_vocab]

Optional on-disk caches:
  `FeatureCache` (legacy, --cache-features): taps and hidden per sample as fp16 safetensors, one file per
      sample, filled during the first epoch.
  `ShardedFeatureCache` (config `feature_cache`, `dspark train --precompute-features`): one pass of the
      target (bf16 by default) over every sample, flat varlen batches of ~tokens_per_forward tokens; per
      shard of many samples one safetensors file with taps + final hidden (bf16) and the full-vocab
      target logsumexp (fp32, only at rows whose next token is supervised, NaN elsewhere). Later steps
      never run the target nor a full-vocab LM head: draft-vocab target logits come from the cached
      hidden times the d2t rows of the LM head (`target_rows(..., lse=...)`). Shards are memory-mapped.
      Several folders (`feature_cache` "A,B", one for each data folder of `--data A,B`, each filled from its
      own data) read as one cache whose keys carry the folder's place, as the data set's do (data.py).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.models.attention import flat_batch
from dspark.models.recurrent import StateRows


@dataclass(frozen=True)
class TargetFeatures:
    taps: torch.Tensor  # [batch, seq_len, num_taps * hidden] (zero on padding)
    hidden: torch.Tensor  # [batch, seq_len, hidden] final-normed last hidden state (zero on padding)
    lse: torch.Tensor | None = None  # [batch, seq_len] fp32 full-vocab target logsumexp (cache only)


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
    valid = torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)  # [batch, seq_len]
    taps, hidden = _flat_features(target, input_ids, lengths, tap_layer_ids)  # [num_tokens, ...]
    out_taps = torch.zeros(batch, seq_len, taps.shape[-1], dtype=taps.dtype)
    out_hidden = torch.zeros(batch, seq_len, cfg.hidden_size, dtype=hidden.dtype)
    out_taps[valid] = taps
    out_hidden[valid] = hidden
    return TargetFeatures(taps=out_taps, hidden=out_hidden)


@torch.no_grad()
def target_rows(
    target,
    hidden: torch.Tensor,  # [batch, seq_len, hidden] final-normed
    *,
    row_mask: torch.Tensor,  # [batch, seq_len] bool: rows whose logits a loss needs
    d2t: torch.Tensor | None,  # [draft_vocab] long target ids, None = the full vocabulary
    chunk: int = 256,
    lse: torch.Tensor | None = None,  # [batch, seq_len] cached full-vocab logsumexp: skip the full head
    head_rows: torch.Tensor | None = None,  # [draft_vocab, hidden] = lm_head.weight[d2t] (precomputed)
) -> TargetRows:
    rows = hidden[row_mask]  # [num_rows, hidden]
    index = torch.full(row_mask.shape, -1, dtype=torch.long)
    index[row_mask] = torch.arange(rows.shape[0])
    param = next(target.parameters())
    if lse is not None:  # cached features: only the draft-vocab rows of the LM head
        w = head_rows if head_rows is not None else (
            target.lm_head.dense_weight(d2t))
        logits = (rows.to(w.dtype) @ w.t()).float()
        return TargetRows(logits=logits, lse=lse[row_mask].float(), index=index)
    draft_vocab = target.config.vocab_size if d2t is None else d2t.numel()
    logits = torch.empty(rows.shape[0], draft_vocab)
    lse = torch.empty(rows.shape[0])
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
                   cache=None) -> TargetFeatures:
    """Features of a data.Batch, through the cache when one is given."""
    if isinstance(cache, ShardedFeatureCache):
        hit = cache.get(batch.keys, batch.lengths)
        if hit is None:
            raise KeyError("feature cache misses samples of this batch; run --precompute-features")
        return hit
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


def noisy_taps(feats: TargetFeatures, *, num_taps: int, scale: float, seed: int) -> TargetFeatures:
    """`TrainConfig.feature_noise`: the taps plus Gaussian noise of std scale × each tap's RMS at each token
    (a zero pad stays zero), drawn from `seed` so a resumed step draws the same; `hidden` (the labels) untouched."""
    taps = feats.taps.float()  # [batch, seq_len, num_taps * hidden]
    per_tap = taps.unflatten(-1, (num_taps, -1))  # [batch, seq_len, num_taps, hidden]
    rms = per_tap.pow(2).mean(-1, keepdim=True).sqrt()  # [batch, seq_len, num_taps, 1]
    gen = torch.Generator(device=taps.device).manual_seed(seed)
    noise = torch.randn(per_tap.shape, generator=gen, device=taps.device, dtype=torch.float32)
    noisy = (per_tap + scale * rms * noise).flatten(-2).to(feats.taps.dtype)
    return TargetFeatures(taps=noisy, hidden=feats.hidden, lse=feats.lse)


# -- sharded, precomputed cache ----------------------------------------------------------------------

def lse_row_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """[..., seq_len] → bool rows whose target logits a loss can need: row p predicts token p+1, so
    rows with loss_mask[p+1] (DSpark/DFlash blocks and EAGLE-3 both only score those)."""
    out = torch.zeros(loss_mask.shape, dtype=torch.bool)
    out[..., :-1] = loss_mask[..., 1:].bool()
    return out


@torch.no_grad()
def full_lse(target, hidden: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """[rows, hidden] → [rows] fp32 logsumexp of the target's full-vocab logits (target's dtype)."""
    param = next(target.parameters())
    out = torch.empty(hidden.shape[0])
    for s in range(0, hidden.shape[0], chunk):
        out[s:s + chunk] = torch.logsumexp(
            target.compute_logits(hidden[s:s + chunk].to(param.device, param.dtype)).float(), dim=-1).cpu()
    return out


class ShardedFeatureCache:
    """Precomputed target features, many samples per safetensors shard (memory-mapped on read).

    Shard `feat-NNNNN.safetensors`: taps [tokens, num_taps*hidden], hidden [tokens, hidden] (bf16 or
    fp16, as stored), lse [tokens] fp32 (NaN where not needed), offsets [samples+1] int64; metadata:
    keys (JSON list), tag (tap layers + target dtype). A key maps to (shard, start, end). `root` may name
    several folders (data.data_roots): read-only, their keys prefixed by the folder's place (data.root_key)."""

    def __init__(self, root: str | Path | list, *, tap_layer_ids: tuple[int, ...], target_dtype: str = "bfloat16"):
        from dspark.train.data import data_roots
        self.roots = data_roots(root)
        self.root = self.roots[0]
        for r in self.roots:
            r.mkdir(parents=True, exist_ok=True)
        self.tag = ",".join(str(i) for i in tap_layer_ids) + "|" + target_dtype
        self._handles: dict[int, object] = {}
        self._index: dict[str, tuple[int, int, int]] = {}
        self._num_shards = 0  # shards in the first folder: the next one written is feat-{_num_shards}
        self.refresh()

    def refresh(self) -> None:
        import json
        from safetensors import safe_open

        from dspark.train.data import root_key
        self._handles.clear()
        self._index.clear()
        paths = [(j, p) for j, r in enumerate(self.roots) for p in sorted(r.glob("feat-*.safetensors"))]
        for sid, (j, p) in enumerate(paths):
            f = safe_open(str(p), "pt")
            meta = f.metadata()
            if meta.get("tag") != self.tag:
                raise ValueError(f"{p} was written for {meta.get('tag')!r}, this run needs {self.tag!r}")
            off = f.get_tensor("offsets").tolist()
            for i, key in enumerate(json.loads(meta["keys"])):
                self._index[root_key(key, j, len(self.roots))] = (sid, off[i], off[i + 1])
            self._handles[sid] = f
        self._num_shards = sum(j == 0 for j, _ in paths)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def get(self, keys: list[str], lengths: torch.Tensor) -> TargetFeatures | None:
        if not all(k in self._index for k in keys):
            return None
        seq_len = int(lengths.max())
        parts = []
        for i, key in enumerate(keys):
            sid, a, b = self._index[key]
            f = self._handles[sid]
            n = min(b - a, int(lengths[i]))  # max_seq_len may cut a sample shorter than stored
            parts.append((f.get_slice("taps")[a:a + n], f.get_slice("hidden")[a:a + n],
                          f.get_slice("lse")[a:a + n]))
        t0, h0 = parts[0][0], parts[0][1]
        taps = torch.zeros(len(keys), seq_len, t0.shape[-1], dtype=t0.dtype)
        hidden = torch.zeros(len(keys), seq_len, h0.shape[-1], dtype=h0.dtype)
        lse = torch.zeros(len(keys), seq_len)
        for i, (t, h, row_lse) in enumerate(parts):
            n = t.shape[0]
            taps[i, :n], hidden[i, :n], lse[i, :n] = t, h, row_lse
        return TargetFeatures(taps=taps, hidden=hidden, lse=lse)

    @torch.no_grad()
    def precompute(self, target, samples, *, tap_layer_ids: tuple[int, ...], tokens_per_forward: int = 4096,
                   samples_per_shard: int = 512, progress: bool = True, log=None) -> dict:
        """Run the target once over every sample (data.Sample) whose key is not cached yet (one folder only)."""
        import json
        import time
        from safetensors.torch import save_file
        if len(self.roots) > 1:
            raise ValueError(f"feature_cache names {len(self.roots)} folders: fill each from its own data folder "
                             "(one --data and one feature_cache a run), then train on them together")
        todo = [s for s in samples if s.key not in self._index]
        todo.sort(key=lambda s: s.input_ids.numel())  # similar lengths per forward: less KV padding
        t_start, tokens = time.perf_counter(), 0
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=sum(s.input_ids.numel() for s in todo), desc="features", unit="tok")
        pending: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def flush():
            nonlocal pending
            if not pending:
                return
            offsets = [0]
            for _, t, _, _ in pending:
                offsets.append(offsets[-1] + t.shape[0])
            path = self.root / f"feat-{self._num_shards:05d}.safetensors"
            tmp = path.with_suffix(".tmp")
            save_file({"taps": torch.cat([p[1] for p in pending]).contiguous(),
                       "hidden": torch.cat([p[2] for p in pending]).contiguous(),
                       "lse": torch.cat([p[3] for p in pending]).contiguous(),
                       "offsets": torch.tensor(offsets, dtype=torch.int64)}, str(tmp),
                      metadata={"keys": json.dumps([p[0] for p in pending]), "tag": self.tag})
            tmp.rename(path)
            self._num_shards += 1
            pending = []

        i = 0
        while i < len(todo):
            group = [todo[i]]
            i += 1
            while i < len(todo) and (len(group) + 1) * todo[i].input_ids.numel() <= tokens_per_forward:
                group.append(todo[i])  # sorted ascending: the newest is the longest (padded KV size)
                i += 1
            lens = torch.tensor([s.input_ids.numel() for s in group])
            ids = torch.zeros(len(group), int(lens.max()), dtype=torch.long)
            for r, s in enumerate(group):
                ids[r, :s.input_ids.numel()] = s.input_ids
            taps, hidden = _flat_features(target, ids, lens, tap_layer_ids)
            need = torch.cat([lse_row_mask(s.loss_mask) for s in group])
            lse = torch.full((hidden.shape[0],), float("nan"))
            lse[need] = full_lse(target, hidden[need])
            store = hidden.dtype if hidden.dtype != torch.float32 else torch.bfloat16
            o = 0
            for s, n in zip(group, lens.tolist()):
                pending.append((s.key, taps[o:o + n].to(store), hidden[o:o + n].to(store), lse[o:o + n]))
                o += n
            tokens += int(lens.sum())
            if bar:
                bar.update(int(lens.sum()))
            if len(pending) >= samples_per_shard:
                flush()
        flush()
        if bar:
            bar.close()
        self.refresh()
        seconds = time.perf_counter() - t_start
        record = {"samples": len(todo), "tokens": tokens, "seconds": seconds,
                  "tokens_per_s": tokens / max(seconds, 1e-9), "cached_samples": len(self._index)}
        if log is not None:
            log.info("feature pass %s", json.dumps(record))
        return record


@torch.no_grad()
def _flat_features(target, input_ids, lengths, tap_layer_ids):
    """Like target_features but returns the flat [num_tokens, ...] taps and hidden (no padding)."""
    batch, seq_len = input_ids.shape
    param = next(target.parameters())
    dtype, device = param.dtype, param.device
    # one kv_block of seq_len slots per sequence: sequence i uses block i
    chunks = [([i], 0, input_ids[i, :int(n)].tolist()) for i, n in enumerate(lengths)]
    ids, positions, meta = flat_batch(chunks, kv_block_size=seq_len, device=device)
    flat_ids = torch.tensor(ids, dtype=torch.long, device=device)
    positions = torch.tensor(positions, dtype=torch.long, device=device)
    specs = target.kv_layer_specs() if hasattr(target, "kv_layer_specs") else [target.kv_spec] * target.num_kv_layers
    kv_caches = [(torch.empty(batch, seq_len, kv_heads, head_dim, dtype=dtype, device=device),
                  torch.empty(batch, seq_len, kv_heads, head_dim, dtype=dtype, device=device))
                 for kv_heads, head_dim in specs]
    kept = getattr(target, "states", None)
    if getattr(target, "has_recurrent_state", False):  # a hybrid target: a state slot per sequence, for this pass
        target.allocate_state(num_slots=batch, window=1, dtype=dtype, device=device)
        offsets = [0, *itertools.accumulate(len(c[2]) for c in chunks)][:-1]
        meta.state = StateRows(tuple(range(len(chunks))), (0,) * len(chunks), tuple(len(c[2]) for c in chunks),
                               tuple(offsets))
    try:
        hidden, taps = target(flat_ids, positions, meta, kv_caches, tap_layer_ids=tuple(tap_layer_ids))
    finally:
        if kept is not None:
            target.states = kept
    return taps.cpu(), hidden.cpu()
