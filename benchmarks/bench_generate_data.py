"""Training-data generation speed: `dspark prepare-data` on the same train/ prompts, plain and with the served
speculative default (`--speculative-config default`), at the batch sizes that data generation runs with, in
alternating child processes round after round (the VM's drifts hit both alike). Greedy, so both write the same
answers: the shards are compared tensor for tensor, and a difference fails the run.

    python benchmarks/bench_generate_data.py --max-prompts 96 --batch-sizes 8,96 --rounds 2 \
        --out benchmarks/results/generate_data_speed.json

`--base REV` compares plain generation at a git revision (extracted with `git archive`, bench_resident.checkout, and
imported from there; its kernels build from its own source) with plain generation from the working tree
instead: what a kernel or engine change did to data generation, the shards again compared.

    python benchmarks/bench_generate_data.py --base HEAD~1 --batch-sizes 8,96 --rounds 2

Reported per configuration and batch size: answer tokens per second (prepare-data's own count over its
generation time, model load excluded), medians over rounds, and default ÷ plain (with `--base`: plain ÷ base).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench_resident import checkout
from dspark.bench.report import run_info, write_result_file
from dspark.train.data import shard_paths

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"plain": [], "default": ["--speculative-config", "default"], "base": []}  # base: plain at --base
RATE = re.compile(r"(\d+) answer tok/s")


def generate(out: Path, *, config: str, batch_size: int, args, tree: Path = ROOT) -> float:
    """One prepare-data run from `tree` into `out`; its overall answer tok/s (the last shard's cumulative rate)."""
    cmd = [sys.executable, "-m", "dspark", "prepare-data", "--out", str(out), "--prompts", args.prompts,
           "--max-prompts", str(args.max_prompts), "--max-tokens", str(args.max_tokens), "--max-prompt-tokens", "384",
           "--long-prompts", "truncate", "--batch-size", str(batch_size), "--matmul-dtype", "q4_1",
           "--num-threads", str(args.threads), *CONFIGS[config]]
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(tree)})
    rates = RATE.findall((out / "prepare.log").read_text())
    if not rates:
        raise SystemExit(f"{out}: prepare-data logged no shard")
    return float(rates[-1])


def same_shards(a: Path, b: Path) -> bool:
    pa, pb = shard_paths(a), shard_paths(b)
    if [p.name for p in pa] != [p.name for p in pb]:
        return False
    for x, y in zip(pa, pb):
        tx, ty = load_file(str(x)), load_file(str(y))
        if tx.keys() != ty.keys() or not all(torch.equal(tx[k], ty[k]) for k in tx):
            return False
    return True


def main(argv: list[str] | None = None) -> dict:
    from dspark.bench.datasets import datasets_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default=str(datasets_dir() / "train"))
    p.add_argument("--max-prompts", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--batch-sizes", default="8,96")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--base", default=None, help="compare plain generation at this git revision instead of "
                                               "speculation on")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    pair = ["base", "plain"] if args.base else ["plain", "default"]  # [reference, compared]
    rates: dict[str, list[float]] = {f"{c}_b{b}": [] for c in pair for b in sizes}
    identical = True
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"plain": ROOT, "default": ROOT}
        if args.base:
            trees["base"] = checkout(args.base, Path(tmp))
        for r in range(args.rounds):
            for b in sizes:
                order = pair if r % 2 == 0 else pair[::-1]
                outs = {c: Path(tmp) / f"{c}_b{b}_r{r}" for c in order}
                for c in order:
                    rates[f"{c}_b{b}"].append(generate(outs[c], config=c, batch_size=b, args=args, tree=trees[c]))
                    print(f"round {r} batch {b} {c}: {rates[f'{c}_b{b}'][-1]:.0f} answer tok/s", flush=True)
                identical &= same_shards(outs[pair[0]], outs[pair[1]])
    summary = {k: statistics.median(v) for k, v in rates.items()}
    for b in sizes:
        summary[f"{pair[1]}_over_{pair[0]}_b{b}"] = round(summary[f"{pair[1]}_b{b}"] / summary[f"{pair[0]}_b{b}"], 3)
    result = {"bench": "generate_data", "summary": summary, "identical_data": identical, "rates": rates,
              "config": vars(args), **run_info(argv)}
    print({k: v for k, v in summary.items()}, "identical data:", identical)
    if args.out:
        write_result_file(args.out, result)
    if not identical:
        raise SystemExit(f"greedy data generated by {pair[1]} differs from {pair[0]}'s")
    return result


if __name__ == "__main__":
    main()
