"""The keyed draw of a step's sampled rows: the working tree's batched inverse-CDF draw (`keyed_samples`, one call
for every row) against a base revision's per-row draw (`keyed_sample` called row by row, as its `sample_step`
did), on the same rows, in alternating rounds (one thread; the VM's drifts hit both alike).

    python benchmarks/bench_keyed_sampling.py --base e6aef33 --rows 1,8,96,768 --vocab 49152 --rounds 7 \
        --out benchmarks/results/keyed_sampling.json

Reported per row count: median milliseconds a step for each side and base ÷ tree. Rows are softmax of
N(0, 2²) logits (T = 1 over SmolLM2's vocabulary); 768 rows are 96 requests verifying 7 drafts each.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_resident import checkout  # noqa: E402
from dspark.engine.sampler import keyed_samples  # noqa: E402


def base_sampler(rev: str, tmp: Path):
    """The sampler module of revision `rev` (its own file; its dspark imports resolve to the working tree)."""
    tree = checkout(rev, tmp)
    spec = importlib.util.spec_from_file_location("base_sampler", tree / "dspark/engine/sampler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ms(fn, repeats: int) -> float:
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose per-row keyed draw is the baseline")
    ap.add_argument("--rows", default="1,8,96,768")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = base_sampler(args.base, Path(tmp))
        report = {"bench": "keyed_sampling", "base": args.base, "vocab": args.vocab, "rounds": args.rounds,
                  "threads": 1, "results": []}
        for rows in [int(r) for r in args.rows.split(",")]:
            probs = torch.softmax(torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)) * 2,
                                  dim=-1)
            keys = [(r, 5 + r) for r in range(rows)]
            repeats = max(1, 200 // rows)
            old = lambda: [base.keyed_sample(probs[r], s, p) for r, (s, p) in enumerate(keys)]  # noqa: E731
            new = lambda: keyed_samples(probs, keys)  # noqa: E731
            old(), new()  # warm-up
            base_ms, tree_ms = [], []
            for _ in range(args.rounds):
                base_ms.append(_ms(old, repeats))
                tree_ms.append(_ms(new, repeats))
            row = {"rows": rows, "base_ms": statistics.median(base_ms), "tree_ms": statistics.median(tree_ms)}
            row["base_over_tree"] = row["base_ms"] / row["tree_ms"]
            report["results"].append(row)
            print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
