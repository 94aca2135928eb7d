"""Batch-1 greedy decode with the kernels of a git revision against the working tree's, side by side: each
round runs one child process per kernel source (`DSPARK_KERNELS_SOURCE`), in alternating order, decoding
the same chat prompts (128 new tokens, EOS ignored) with the same matmul dtype and, with --spec, the shipped
speculative default. A kernel change that speeds up multi-row products can still slow the one-row steps
that stream the weights from memory; this measures the whole decode, where a microbenchmark keeps the
weights in cache.

    python benchmarks/bench_decode_kernels.py --base 539f52d --rounds 3 --out benchmarks/results/decode_kernels.json

Reported: per kernel source the median over rounds of the per-round median decode tok/s, every
per-prompt rate, and new ÷ base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dspark.bench.report import run_info, write_result_file
from kernel_revision import write_revision

# one pass of bench_decode.py's dspark engine (the same prompts, warm-up and rates) in a child process
CHILD = """
import json, sys, torch
sys.path.insert(0, {bench_dir!r})
torch.set_num_threads({threads})
from bench_decode import bench_dspark, prompts
from dspark.engine.build import resolve_matmul_dtype
from dspark.models.loader import resolve_model_path
from dspark.models.tokenizer import load_tokenizer
tok = load_tokenizer(resolve_model_path("default"))
chat_ids = [tok.apply_chat_template([{{"role": "user", "content": p}}]) for p in prompts({num_prompts}, {datasets!r})]
dtype = resolve_matmul_dtype({dtype!r}, model="SmolLM2-135M-Instruct")
print(json.dumps(bench_dspark(chat_ids, dtype, spec={spec})))
"""


def _env(source: Path) -> dict:
    """This process's environment with the kernels built from `source` (and required to build)."""
    return {**os.environ, "DSPARK_KERNELS_SOURCE": str(source), "DSPARK_CPU_KERNELS": "require"}


def decode_rates(source: Path, args: argparse.Namespace) -> list[float]:
    code = CHILD.format(bench_dir=str(Path(__file__).resolve().parent), threads=args.threads, dtype=args.matmul_dtype,
                        spec=bool(args.spec), datasets=args.datasets, num_prompts=args.num_prompts)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(source), check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose CPU kernels (dspark/kernels/cpu_ops*) to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--datasets", default="gsm8k,humaneval")
    ap.add_argument("--matmul-dtype", default="auto")
    ap.add_argument("--spec", action="store_true", help="the shipped speculative default instead of plain decoding")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        base = write_revision(args.base, Path(tmp))
        sources = {"base": base, "new": repo / "dspark" / "kernels" / "cpu_ops.cpp"}
        for source in sources.values():  # build both before timing
            subprocess.run([sys.executable, "-m", "dspark.kernels"], env=_env(source), check=True, capture_output=True)
        rates: dict[str, list[list[float]]] = {name: [] for name in sources}
        for r in range(args.rounds):
            for name in (list(sources) if r % 2 == 0 else list(sources)[::-1]):
                rates[name].append(decode_rates(sources[name], args))
                print(f"round {r} {name}: {statistics.median(rates[name][-1]):.1f} tok/s", flush=True)
    medians = {name: statistics.median(statistics.median(rr) for rr in runs) for name, runs in rates.items()}
    result = {"bench": "decode_kernels", **run_info(), "base": args.base, "matmul_dtype": args.matmul_dtype,
              "spec": bool(args.spec), "rounds": args.rounds,
              "decode_tok_s_median": {k: round(v, 1) for k, v in medians.items()},
              "new_over_base": round(medians["new"] / medians["base"], 3), "per_prompt": rates}
    print(json.dumps({k: v for k, v in result.items() if k != "per_prompt"}))
    if args.out:
        write_result_file(args.out, result)


if __name__ == "__main__":
    main()
