"""Prepared training data: token shards written by `dspark prepare-data`, read by `dspark train`.

Layout of a data folder:
    manifest.json              what made the data (model, sampling, max tokens, holdout fraction, counts)
    shard-00000.safetensors    input_ids int32 [total_tokens], loss_mask uint8 [total_tokens],
                               offsets int64 [num_samples + 1], is_val uint8 [num_samples];
                               metadata "keys": JSON list of the prompt keys in this shard
    dropped.txt                prompt keys skipped for good (too long / too short answer)
    prepare.log

Targets (taps, logits) are not stored: `features.py` computes them online from the same models/ code.
The holdout split is decided by a hash of the prompt key, so it is stable across resumes and sizes.
Several folders (`--data A,B`, e.g. stages of sampled answers to one prompt pool) read as one data set; their
keys then carry the folder's place in the list ("1/gsm8k:12"), since such folders share prompt keys.

    ds = TokenDataset("data/smollm2_train", split="train", max_seq_len=1024)
    sampler = BatchSampler(num_samples=len(ds), global_batch=8, seed=0)
    indices, cursor = sampler.next_batch(Cursor())
    batch = collate([ds[i] for i in indices])
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

MANIFEST = "manifest.json"
DROPPED = "dropped.txt"
EVAL_DIR_MARKER = "/datasets/eval"


def assert_not_eval(path: str | Path) -> None:
    """Training must never see the evaluation prompts."""
    resolved = str(Path(path).resolve())
    assert EVAL_DIR_MARKER not in resolved, f"refusing to read evaluation prompts for training: {resolved}"


def is_holdout(key: str, frac: float) -> bool:
    h = int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "little")
    return h / 2 ** 64 < frac


@dataclass(frozen=True)
class Sample:
    key: str
    index: int  # position in the dataset split (seeds the anchors of this sequence)
    input_ids: torch.Tensor  # [seq_len] long
    loss_mask: torch.Tensor  # [seq_len] uint8, 1 on assistant tokens


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [batch, seq_len] long, right-padded with 0
    loss_mask: torch.Tensor  # [batch, seq_len] uint8, 0 on padding
    lengths: torch.Tensor  # [batch] long
    indices: list[int]  # dataset index of each row
    keys: list[str]


def write_shard(path: Path, samples: list[tuple[str, list[int], list[int], bool]]) -> None:
    """samples: (key, input_ids, loss_mask, is_val). Written to a temp name, then renamed (atomic)."""
    ids = [t for _, s, _, _ in samples for t in s]
    mask = [m for _, _, s, _ in samples for m in s]
    offsets = [0]
    for _, s, _, _ in samples:
        offsets.append(offsets[-1] + len(s))
    tensors = {
        "input_ids": torch.tensor(ids, dtype=torch.int32),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "is_val": torch.tensor([int(v) for *_, v in samples], dtype=torch.uint8),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"keys": json.dumps([k for k, *_ in samples])})
    tmp.rename(path)


def shard_paths(root: str | Path) -> list[Path]:
    return sorted(Path(root).glob("shard-*.safetensors"))


def done_keys(root: str | Path, *, redo_dropped: tuple[str, ...] = ()) -> set[str]:
    """Prompt keys already written (or dropped, unless for a reason in `redo_dropped`): prepare-data
    skips them on resume."""
    root = Path(root)
    keys: set[str] = set()
    for p in shard_paths(root):
        with safe_open(str(p), "pt") as f:
            keys.update(json.loads(f.metadata()["keys"]))
    if (root / DROPPED).exists():
        for line in (root / DROPPED).read_text().splitlines():
            key, _, reason = line.partition("\t")
            if key and reason not in redo_dropped:
                keys.add(key)
    return keys


def data_roots(spec: str | Path | list) -> list[Path]:
    """The folders of a data argument: one path, a comma-separated list, or a list of either; each named once."""
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    roots = [Path(r.strip()) for item in items for r in str(item).split(",") if r.strip()]
    if not roots:
        raise ValueError("no data folder given")
    if len({r.resolve() for r in roots}) != len(roots):
        raise ValueError(f"a data folder is listed twice: {', '.join(map(str, roots))}")
    return roots


def check_feature_caches(data: str | Path | list, feature_cache: str | None) -> None:
    """`feature_cache` names no folder, one, or one for each data folder (in the same order)."""
    num_data, num_caches = len(data_roots(data)), len(data_roots(feature_cache)) if feature_cache else 0
    if num_caches > 1 and num_caches != num_data:
        raise ValueError(f"feature_cache names {num_caches} folders for {num_data} data folders: "
                         "name one, or one for each data folder in the same order")


def root_key(key: str, index: int, num_roots: int) -> str:
    """A sample's key in a data set of `num_roots` folders: unchanged for one, else prefixed by its folder."""
    return key if num_roots == 1 else f"{index}/{key}"


class TokenDataset:
    """All samples of one split in memory (token ids are small: 4 bytes a token); `root` may name several
    folders (`data_roots`), read in order as one data set."""

    def __init__(self, root: str | Path | list, *, split: str = "train", max_seq_len: int | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.roots = data_roots(root)
        self.root = self.roots[0]
        shards: list[tuple[int, Path]] = []
        for j, r in enumerate(self.roots):
            assert_not_eval(r)
            paths = shard_paths(r)
            if not paths:
                raise FileNotFoundError(f"no shard-*.safetensors in {r}; run `dspark prepare-data` first")
            shards += [(j, p) for p in paths]
        self.manifest = json.loads((self.root / MANIFEST).read_text()) if (self.root / MANIFEST).exists() else {}
        want_val = split == "val"
        self.samples: list[Sample] = []
        for j, p in shards:
            with safe_open(str(p), "pt") as f:
                keys = [root_key(k, j, len(self.roots)) for k in json.loads(f.metadata()["keys"])]
            t = load_file(str(p))
            off = t["offsets"].tolist()
            for i, key in enumerate(keys):
                if bool(t["is_val"][i]) != want_val:
                    continue
                ids = t["input_ids"][off[i]:off[i + 1]].long()
                mask = t["loss_mask"][off[i]:off[i + 1]]
                if max_seq_len is not None:
                    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                if int(mask.sum()) < 2:
                    continue
                self.samples.append(Sample(key, len(self.samples), ids, mask))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]

    def num_tokens(self) -> int:
        return sum(s.input_ids.numel() for s in self.samples)


def collate(samples: list[Sample], *, pad_id: int = 0) -> Batch:
    lengths = torch.tensor([s.input_ids.numel() for s in samples], dtype=torch.long)
    seq_len = int(lengths.max())
    ids = torch.full((len(samples), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), seq_len, dtype=torch.uint8)
    for i, s in enumerate(samples):
        ids[i, :s.input_ids.numel()] = s.input_ids
        mask[i, :s.loss_mask.numel()] = s.loss_mask
    return Batch(ids, mask, lengths, [s.index for s in samples], [s.key for s in samples])


@dataclass(frozen=True)
class Cursor:
    """Where the data stream stands: epoch and the next index into that epoch's permutation."""

    epoch: int = 0
    position: int = 0


@dataclass(frozen=True)
class BatchSampler:
    """Deterministic epoch permutations (seed + epoch); the last partial global batch is dropped.
    Every rank computes the same global batch and takes its own slice, so the order does not depend on
    the world size."""

    num_samples: int
    global_batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_samples < self.global_batch:
            raise ValueError(f"{self.num_samples} samples cannot fill one global batch of {self.global_batch}")

    def permutation(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def next_batch(self, cursor: Cursor) -> tuple[list[int], Cursor]:
        if cursor.position + self.global_batch > self.num_samples:
            cursor = Cursor(cursor.epoch + 1, 0)
        perm = self.permutation(cursor.epoch)
        end = cursor.position + self.global_batch
        return perm[cursor.position:end], Cursor(cursor.epoch, end)

    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch


def token_counts(dataset: TokenDataset, *, vocab_size: int, assistant_only: bool = False) -> torch.Tensor:
    """[vocab_size] long: how often each token appears. By default every position counts once and
    assistant tokens once more, so the vocabulary leans toward what the drafter must predict while
    prompt-only tokens (which anchors and Markov predecessors still see) are not ignored."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in dataset.samples:
        if not assistant_only:
            counts += torch.bincount(s.input_ids, minlength=vocab_size)[:vocab_size]
        counts += torch.bincount(s.input_ids[s.loss_mask.bool()], minlength=vocab_size)[:vocab_size]
    return counts


def t2d_labels(ids: torch.Tensor, d2t: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Target ids → draft ids, -100 for tokens outside the draft vocab (and for -100 inputs)."""
    table = torch.full((vocab_size,), -100, dtype=torch.long)
    table[d2t] = torch.arange(d2t.numel())
    return torch.where(ids >= 0, table[ids.clamp(min=0)], torch.full_like(ids, -100))
