"""`dspark build-corpus`: a lookup corpus (dspark.drafters.corpus) from `dspark prepare-data` output: the
answers the target wrote to training prompts, each a document. The held-out split stays out unless
`--split all`, so acceptance measured on the held-out prompts is measured on text the corpus never saw.

    dspark build-corpus --data data/train --out dspark/assets/drafters/lookup-smollm2-135m/corpus.safetensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark.drafters.corpus import describe, write_corpus
from dspark.train.data import TokenDataset


def answers(root: str | Path, *, split: str) -> tuple[list[list[int]], dict]:
    """The assistant tokens (loss mask 1) of each sample of `split` (train, val or all) in a prepare-data
    folder (`TokenDataset`: eval/ refused), and its manifest."""
    sets = [TokenDataset(root, split=s) for s in (("train", "val") if split == "all" else (split,))]
    docs = [s.input_ids[s.loss_mask.bool()].tolist() for ds in sets for s in ds.samples]
    return docs, sets[0].manifest


def register(sub) -> None:
    p = sub.add_parser("build-corpus", help="a lookup corpus from prepare-data output (the target's own answers)")
    p.add_argument("--data", nargs="+", required=True, help="prepare-data output folders")
    p.add_argument("--out", required=True, help="the corpus file (.safetensors)")
    p.add_argument("--split", choices=("train", "all"), default="train",
                   help="train: without the held-out prompts' answers (default); all: with them")
    p.add_argument("--model", default=None, help="the target (default: the model the data name)")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from dspark.models.loader import read_model_config
    docs, models = [], set()
    for root in args.data:
        try:
            found, manifest = answers(root, split=args.split)
        except (AssertionError, FileNotFoundError) as e:
            raise SystemExit(f"error: --data {root}: {e}") from None
        docs += found
        models.add(manifest.get("config", {}).get("model", "default"))
    model = args.model or (models.pop() if len(models) == 1 else None)
    if model is None:
        raise SystemExit(f"error: --data folders were written by different models ({', '.join(sorted(models))}); "
                         "name the target with --model")
    vocab = read_model_config(model).vocab_size
    meta = write_corpus(args.out, docs, vocab_size=vocab, model=str(model),
                        source=",".join(str(Path(d)) for d in args.data) + f" ({args.split} split)")
    print(describe(meta))
    return 0
