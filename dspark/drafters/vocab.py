"""Draft vocabularies: the `d2t` map (draft id → target id) as checkpoints store it, and a reduced draft
vocabulary chosen at load for a full-vocabulary checkpoint (spec "draft_vocab_size").

Stored `d2t`. Every checkpoint dspark writes (`save_dspark`, `save_eagle3`, `dspark train`'s export) stores it
as *offsets*, the convention of the EAGLE-3 reference code, vLLM Speculators, vLLM, SGLang and llama.cpp:
target id = draft id + d2t[draft id], and says so in its config.json (`"d2t_format": "offset"`). In memory
`d2t` is always absolute target ids. Reading takes either convention, decided per checkpoint (`decode_d2t`):

1. config.json's `d2t_format` ("offset" or "absolute") where it has one; a d2t that is not a valid map under
   the reading it names is refused;
2. otherwise the reading that gives a *valid* map (distinct target ids in [0, vocab_size)) where only one
   does: offsets of an ascending table read as absolute ids repeat (zeros at the start, say), and absolute ids
   read as offsets run past the vocabulary once the table reaches its top;
3. where both readings are valid and differ: offsets for the ecosystem's formats (Speculators, DeepSpec
   EAGLE-3: `formats.checkpoint_format` other than "native") and absolute ids for this project's own
   checkpoints written before the key existed ("native"); which one is logged;
4. where neither is valid: refused.

Every refusal names `d2t`. A Speculators boolean `t2d` must mark the same target ids, and a Speculators d2t
over the whole vocabulary must be the identity (it is read as no reduced vocabulary). `read_d2t` reads the
d2t (and t2d) tensors alone, so the registry's `check` refuses a bad map before any weight loads.

Reduced vocabulary at load (`"draft_vocab_size": N` on a checkpoint without `d2t`, `draft_vocab_at_load`):
the drafter keeps N target tokens, the target's special tokens (its eos ids and bos) and the most frequent
others in `lookup_corpus` (a `dspark build-corpus` file: the target's own answers from `dspark prepare-data`),
chosen by `build_draft_vocab`, the code that chose the shipped drafters' vocabularies (ties: the
lower id). Its LM head (and DSpark's Markov W2) keep those rows; Markov W1 keeps every target row (a
predecessor, the anchor among them, is any target token). Drafts are the full drafter's restricted to the
subset (the argmax over it, or its probabilities renormalised on it); verification covers the full
vocabulary, where a draft distribution is zero outside the subset. Refused before any weight loads, each
naming `draft_vocab_size`: N above the target's vocabulary, N below the number of special tokens kept, a
checkpoint whose own d2t has another size, and no `lookup_corpus` to count from. A checkpoint whose d2t has
N entries is used as it is; N equal to the target's vocabulary is the full vocabulary.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dspark.drafters.checkpoint import load_named, read_config

log = logging.getLogger(__name__)

D2T_FORMAT_KEY = "d2t_format"
D2T_FORMATS = ("offset", "absolute")
WRITTEN_FORMAT = "offset"  # what every checkpoint dspark writes stores
MAP_NAMES = ("d2t", "t2d")  # the vocabulary maps: read here, never with the weights


def to_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """Absolute target ids [N] → the offsets a checkpoint stores (target id − draft id), int64."""
    return d2t.long() - torch.arange(d2t.numel(), device=d2t.device)


def valid_map(ids: torch.Tensor, vocab_size: int) -> bool:
    """Whether `ids` [N] are distinct target ids in [0, vocab_size)."""
    if ids.numel() == 0:
        return False
    return int(ids.min()) >= 0 and int(ids.max()) < vocab_size and int(ids.unique().numel()) == ids.numel()


def decode_d2t(stored: torch.Tensor, *, vocab_size: int, config: dict, where: str) -> torch.Tensor:
    """A checkpoint's stored d2t [N] → absolute target ids [N] long, by the rule of the module docstring."""
    from dspark.drafters.formats import checkpoint_format
    stored = stored.long().flatten()
    readings = {"absolute": stored, "offset": stored + torch.arange(stored.numel(), device=stored.device)}
    valid = {name: valid_map(ids, vocab_size) for name, ids in readings.items()}
    named = config.get(D2T_FORMAT_KEY)
    if named is not None:
        if named not in D2T_FORMATS:
            raise ValueError(f"{where}: d2t_format {named!r} unknown; choose from {', '.join(D2T_FORMATS)}")
        if not valid[named]:
            raise ValueError(f"{where}: d2t (d2t_format {named!r}) must hold distinct target ids in "
                             f"[0, {vocab_size}): {_what_is_wrong(readings[named], vocab_size)}")
        return readings[named]
    if not any(valid.values()):
        raise ValueError(f"{where}: d2t must hold distinct target ids in [0, {vocab_size}) either as absolute "
                         f"ids ({_what_is_wrong(readings['absolute'], vocab_size)}) or as offsets "
                         f"({_what_is_wrong(readings['offset'], vocab_size)})")
    if all(valid.values()) and not torch.equal(readings["absolute"], readings["offset"]):
        fmt = checkpoint_format(config)
        chosen = "absolute" if fmt == "native" else "offset"
        log.info("%s: d2t reads as valid absolute ids and as valid offsets and config.json has no d2t_format; "
                 "read as %s (the convention of %s checkpoints)", where, chosen,
                 "this project's older" if fmt == "native" else f"{fmt}")
        return readings[chosen]
    return readings["offset"] if valid["offset"] else readings["absolute"]


def _what_is_wrong(ids: torch.Tensor, vocab_size: int) -> str:
    if ids.numel() == 0:
        return "it is empty"
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        return f"they span [{int(ids.min())}, {int(ids.max())}]"
    return f"{ids.numel() - int(ids.unique().numel())} repeated"


def read_maps(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's `d2t` / `t2d` tensors (those it has), read alone: no other tensor's data."""
    return load_named(path, MAP_NAMES)


def read_d2t(path: str | Path, *, vocab_size: int, where: str) -> torch.Tensor | None:
    """The checkpoint's draft vocabulary as absolute target ids [N] long, or None (the full vocabulary):
    its stored d2t decoded and checked (against Speculators' t2d where there is one)."""
    from dspark.drafters.formats import checkpoint_format
    maps = read_maps(path)
    if "d2t" not in maps:
        return None
    config = read_config(path)
    stored, t2d = maps["d2t"], maps.get("t2d")
    speculators = checkpoint_format(config).startswith("speculators-")
    if speculators and t2d is not None and stored.numel() == t2d.numel():  # the whole vocabulary
        ids = stored.long() + torch.arange(stored.numel())
        if not torch.equal(ids, torch.arange(ids.numel())):
            raise ValueError(f"{where}: a full-vocabulary d2t that is not the identity is unsupported")
        return None
    ids = decode_d2t(stored, vocab_size=vocab_size, config=config, where=where)
    if speculators and t2d is not None:
        mask = t2d.bool()
        if mask.numel() != vocab_size or int(mask.sum()) != ids.numel() or not bool(mask[ids].all()):
            raise ValueError(f"{where}: d2t and t2d disagree: not the same draft vocabulary")
    return ids


# -- a reduced vocabulary chosen at load -------------------------------------------------------------

def special_token_ids(target_config) -> tuple[int, ...]:
    """The target's special tokens a reduced vocabulary always keeps: its eos ids and bos."""
    ids = [*getattr(target_config, "eos_token_ids", ()), getattr(target_config, "bos_token_id", None)]
    return tuple(sorted({int(i) for i in ids if i is not None and 0 <= int(i) < target_config.vocab_size}))


def slices_at_load(spec, target_config, *, checkpoint_draft_vocab: int | None, where: str) -> bool:
    """Whether spec "draft_vocab_size" slices this checkpoint at load; each misfit refused (ValueError naming
    draft_vocab_size) from config.json alone, before any weight loads. `checkpoint_draft_vocab`: the size of
    the checkpoint's own d2t (None: the full vocabulary)."""
    size = getattr(spec, "draft_vocab_size", None)
    if size is None:
        return False
    vocab = target_config.vocab_size
    if size > vocab:
        raise ValueError(f"draft_vocab_size {size} is larger than the target's vocabulary ({vocab} tokens)")
    if checkpoint_draft_vocab is not None:
        if checkpoint_draft_vocab != size:
            raise ValueError(f"draft_vocab_size {size}: {where} already has a reduced vocabulary (a d2t of "
                             f"{checkpoint_draft_vocab} tokens); leave draft_vocab_size out or give "
                             f"{checkpoint_draft_vocab}")
        return False
    if size == vocab:
        return False
    specials = special_token_ids(target_config)
    if size < len(specials):
        raise ValueError(f"draft_vocab_size {size} is smaller than the {len(specials)} special tokens a reduced "
                         f"vocabulary always keeps (eos and bos ids {list(specials)})")
    if not spec.lookup_corpus:
        raise ValueError(f"draft_vocab_size {size}: {where} has no d2t, so the {size} tokens are the most frequent "
                         "in the target's own answers; give \"lookup_corpus\": a corpus file from `dspark "
                         "build-corpus --data <dspark prepare-data output>`")
    return True


def corpus_token_counts(path: str | Path, *, vocab_size: int) -> torch.Tensor:
    """[vocab_size] long: how often each token occurs in a lookup corpus file (`dspark build-corpus`)."""
    from safetensors.numpy import load_file

    from dspark.drafters.corpus import check_corpus
    check_corpus(path, vocab_size=vocab_size)
    tokens = torch.from_numpy(load_file(str(path))["tokens"]).long()
    return torch.bincount(tokens[tokens >= 0], minlength=vocab_size)[:vocab_size]


def draft_vocab_at_load(spec, target_config, *, checkpoint_draft_vocab: int | None, where: str
                        ) -> torch.Tensor | None:
    """The target ids [draft_vocab_size] (ascending) a full-vocabulary checkpoint keeps at load, or None
    (nothing to slice)."""
    if not slices_at_load(spec, target_config, checkpoint_draft_vocab=checkpoint_draft_vocab, where=where):
        return None
    counts = corpus_token_counts(spec.lookup_corpus, vocab_size=target_config.vocab_size)
    keep = build_draft_vocab(counts, size=spec.draft_vocab_size, always=special_token_ids(target_config))
    log.info("draft_vocab_size %d: the drafter scores %d of %d target tokens, %.2f%% of %s's tokens",
             spec.draft_vocab_size, keep.numel(), target_config.vocab_size, 100 * vocab_coverage(counts, keep),
             spec.lookup_corpus)
    return keep


def build_draft_vocab(counts: torch.Tensor, *, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """d2t [size] long, ascending target ids: the `always` ids (EOS, ...) plus the most frequent tokens;
    ties broken by the lower id so the result is deterministic. size >= vocab → the identity map."""
    vocab = counts.numel()
    if size >= vocab:
        return torch.arange(vocab)
    score = counts.double() - torch.arange(vocab, dtype=torch.float64) / vocab  # frequency, then low id
    score[list(always)] = float("inf")
    return score.topk(size).indices.sort().values


def vocab_coverage(counts: torch.Tensor, d2t: torch.Tensor) -> float:
    return float(counts[d2t].sum()) / max(1, int(counts.sum()))
