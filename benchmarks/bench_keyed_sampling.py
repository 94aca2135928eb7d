"""The keyed draw of a step's sampled rows: the working tree's batched inverse-CDF draw (`keyed_samples`, one call
for every row) against a base revision's per-row draw (`keyed_sample` called row by row, as its `sample_step`
did), on the same rows, in alternating rounds (one thread; the VM's drifts hit both alike).

    python benchmarks/bench_keyed_sampling.py --base e6aef33 --rows 1,8,96,768 --vocab 49152 --rounds 7 \
        --out benchmarks/results/keyed_sampling.json

Reported per row count: median milliseconds a step for each side and base ÷ tree. Rows are softmax of
N(0, 2²) logits (T = 1 over SmolLM2's vocabulary); 768 rows are 96 requests verifying 7 drafts each.

`--e2e-batch N` also times sampled decoding end to end: `LLM.generate` of N seeded T = 1 requests (the default
model, plain decoding, 2 threads) in child processes importing the base revision's tree and the working tree in
turn, `--e2e-rounds` rounds; output tokens a second, model load and a warm-up excluded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_resident import checkout  # noqa: E402
from dspark.verify.sampler import keyed_samples  # noqa: E402


def base_sampler(rev: str, tmp: Path):
    """The sampler module of revision `rev` (its own file; its dspark imports resolve to the working tree)."""
    tree = checkout(rev, tmp)
    spec = importlib.util.spec_from_file_location("base_sampler", tree / "dspark/verify/sampler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


E2E_CHILD = r"""
import json, sys, time
from dspark.llm import LLM
from dspark.sampling import SamplingParams
n, tokens = int(sys.argv[1]), int(sys.argv[2])
llm = LLM("SmolLM2-135M-Instruct", num_threads=2, max_num_seqs=n)
prompts = [f"Write a short story about the number {i}." for i in range(n)]
params = [SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=i) for i in range(n)]
llm.generate(prompts[:2], params[:2], use_tqdm=False)
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
dt = time.perf_counter() - t
import dspark.verify.sampler as sampler
print(json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt, "sampler": sampler.__file__}))
"""


def e2e_tok_s(tree: Path, batch: int, tokens: int) -> float:
    """Sampled decoding tok/s of the dspark package under `tree` (a child process)."""
    out = subprocess.run([sys.executable, "-c", E2E_CHILD, str(batch), str(tokens)], capture_output=True, text=True,
                         check=True, cwd=str(tree), env={**os.environ, "PYTHONPATH": str(tree), "TQDM_DISABLE": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["sampler"]).is_relative_to(tree), f"the child imported {result['sampler']}, not {tree}"
    return result["tok_s"]


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
    ap.add_argument("--e2e-batch", type=int, default=0, help="also time T = 1 decoding of this many requests")
    ap.add_argument("--e2e-tokens", type=int, default=64)
    ap.add_argument("--e2e-rounds", type=int, default=3)
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
        if args.e2e_batch:
            root = Path(__file__).resolve().parents[1]
            sides = {"base": [], "tree": []}
            for _ in range(args.e2e_rounds):
                sides["base"].append(e2e_tok_s(Path(tmp) / "tree", args.e2e_batch, args.e2e_tokens))
                sides["tree"].append(e2e_tok_s(root, args.e2e_batch, args.e2e_tokens))
            e2e = {"batch": args.e2e_batch, "tokens": args.e2e_tokens, "rounds": sides,
                   "base_tok_s": statistics.median(sides["base"]), "tree_tok_s": statistics.median(sides["tree"])}
            e2e["tree_over_base"] = e2e["tree_tok_s"] / e2e["base_tok_s"]
            report["e2e"] = e2e
            print(json.dumps(e2e))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
