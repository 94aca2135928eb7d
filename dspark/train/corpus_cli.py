"""`dspark build-corpus`: a lookup corpus (dspark.drafters.corpus) from `dspark prepare-data` output: the
answers the target wrote to training prompts, each a document. The held-out split stays out unless
`--split all`, so acceptance measured on the held-out prompts is measured on text the corpus never saw.
Each answer keeps the last `--prompt-tokens` tokens of its prompt before it (the chat template's generation
header, the same in every conversation), so a lookup at the start of an answer matches the start of every
answer, not the few places where the header's tokens occur inside one (tokens a step with prompt lookup and
the corpus, held-out math / code / chat: 1.65 / 1.80 / 2.09 with answers alone, 1.69 / 1.82 / 2.13 with 5).

A `--data` entry may also be a corpus file this command wrote (its documents are taken as they are, so a corpus
grows by new prepare-data folders without the old ones): it must hold the same split and prompt tokens as asked.
A document equal to an earlier one (a sampled answer that came out as the greedy one, a request asked twice) is
kept once.

    dspark build-corpus --data data/train --out dspark/assets/drafters/lookup-smollm2-135m/corpus.safetensors
    dspark build-corpus --data old.safetensors data/more --out corpus.safetensors
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from dspark.drafters.corpus import SEP, describe, write_corpus
from dspark.train.data import TokenDataset

# what a corpus's `source` metadata says after the folders it was built from, and how it is read back
SOURCE_TAIL = " ({split} split, {prompt_tokens} prompt tokens before each answer)"
SOURCE_TAIL_RE = re.compile(r" \((\w+) split, (\d+) prompt tokens before each answer\)$")


def answers(root: str | Path, *, split: str, prompt_tokens: int = 0) -> tuple[list[list[int]], dict]:
    """The assistant tokens (loss mask 1) of each sample of `split` (train, val or all) in a prepare-data
    folder (`TokenDataset`: eval/ refused), each after the last `prompt_tokens` tokens of its prompt, and the
    folder's manifest."""
    sets = [TokenDataset(root, split=s) for s in (("train", "val") if split == "all" else (split,))]
    docs = []
    for s in (s for ds in sets for s in ds.samples):
        answer = s.loss_mask.bool()  # [len]: the answer, after the prompt
        start = int(answer.nonzero()[0]) if answer.any() else len(answer)
        docs.append(s.input_ids[max(0, start - prompt_tokens):start].tolist() + s.input_ids[answer].tolist())
    return docs, sets[0].manifest


def corpus_documents(path: str | Path, *, split: str, prompt_tokens: int) -> tuple[list[list[int]], str, str]:
    """The documents of a corpus file `build-corpus` wrote, the model and the data folders it names, after
    checking that its split and prompt tokens (from its `source` metadata) are the ones asked for."""
    from safetensors import safe_open
    with safe_open(str(path), "np") as f:
        meta, tokens = f.metadata() or {}, f.get_tensor("tokens") if "tokens" in f.keys() else None
    found = SOURCE_TAIL_RE.search(meta.get("source", ""))
    if tokens is None or found is None:
        raise ValueError("not a corpus file from `dspark build-corpus` (no tokens, or no split and prompt "
                         "tokens in its metadata)")
    if (found[1], int(found[2])) != (split, prompt_tokens):
        raise ValueError(f"holds the {found[1]} split with {found[2]} prompt tokens before each answer; asked: "
                         f"the {split} split with --prompt-tokens {prompt_tokens}")
    ends = np.flatnonzero(tokens == SEP)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[a:b].tolist() for a, b in zip(starts, ends)], meta.get("model", "default"), \
        meta["source"][:found.start()]


def unique(documents: list[list[int]]) -> tuple[list[list[int]], int]:
    """`documents` with each repeat of an earlier one left out (the first kept, order kept), and how many were."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for doc in documents:
        key = tuple(doc)
        if key not in seen:
            seen.add(key)
            out.append(doc)
    return out, len(documents) - len(out)


def register(sub) -> None:
    p = sub.add_parser("build-corpus", help="a lookup corpus from prepare-data output (the target's own answers)")
    p.add_argument("--data", nargs="+", required=True,
                   help="prepare-data output folders, or corpus files this command wrote (their documents as they are)")
    p.add_argument("--out", required=True, help="the corpus file (.safetensors)")
    p.add_argument("--split", choices=("train", "all"), default="train",
                   help="train: without the held-out prompts' answers (default); all: with them")
    p.add_argument("--prompt-tokens", type=int, default=5,
                   help="prompt tokens kept before each answer (its generation header; default 5, the longest "
                        "lookup suffix by default); 0: the answers alone")
    p.add_argument("--model", default=None, help="the target (default: the model the data name)")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from dspark.models.loader import read_model_config
    if args.prompt_tokens < 0:
        raise SystemExit(f"error: --prompt-tokens must be >= 0, got {args.prompt_tokens}")
    docs, models, sources = [], set(), []
    for root in args.data:
        try:
            if Path(root).is_file():  # its source: the folders it was built from
                found, named, source = corpus_documents(root, split=args.split, prompt_tokens=args.prompt_tokens)
            else:
                found, manifest = answers(root, split=args.split, prompt_tokens=args.prompt_tokens)
                named, source = manifest.get("config", {}).get("model", "default"), str(Path(root))
        except (AssertionError, FileNotFoundError, ValueError) as e:
            raise SystemExit(f"error: --data {root}: {e}") from None
        docs += found
        models.add(named)
        sources.append(source)
    docs, repeats = unique(docs)
    model = args.model or (models.pop() if len(models) == 1 else None)
    if model is None:
        raise SystemExit(f"error: --data folders were written by different models ({', '.join(sorted(models))}); "
                         "name the target with --model")
    vocab = read_model_config(model).vocab_size
    meta = write_corpus(args.out, docs, vocab_size=vocab, model=str(model),
                        source=",".join(sources) + SOURCE_TAIL.format(split=args.split, prompt_tokens=args.prompt_tokens),
                        repeats_dropped=repeats)
    print(describe(meta))
    return 0
