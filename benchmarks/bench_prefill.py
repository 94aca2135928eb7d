"""Prompt processing (time to first token) of one request at a time, matmul dtypes side by side in one
process: each round runs every prompt length with every dtype once (medians over rounds), so a slow
phase of the machine hits all alike. No speculation; the prompts are eval/ text cut to each length.

    python benchmarks/bench_prefill.py --matmul-dtypes float32,q4_1 --lengths 128,512 --out benchmarks/results/prefill.json

`--attention-tiles 1,24` also alternates the CPU attention kernel's tile size (query heads sharing each key
and value load; 1: untiled, the same results) within every round.

`--base REV` compares a git revision with the working tree instead: this script runs in alternating child
processes (`--rounds` each), one importing the revision (extracted with `git archive`, bench_resident.checkout), one the
working tree, `--ab-rounds` times; medians over the children, and base ÷ tree per length.

    python benchmarks/bench_prefill.py --base HEAD~1 --matmul-dtypes auto --lengths 40,100,128,512 --ab-rounds 3
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

from bench_resident import checkout
from dspark.bench.report import run_info, write_result_file

ROOT = Path(__file__).resolve().parents[1]


def compare_revision(args, argv: list[str] | None) -> dict:
    """`--base`: this script without --base from the revision's tree and from the working tree, alternating."""
    child = ["--matmul-dtypes", args.matmul_dtypes, "--lengths", args.lengths, "--rounds", str(args.rounds)]
    ttft: dict[str, dict[str, list[float]]] = {"base": {}, "tree": {}}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": checkout(args.base, Path(tmp)), "tree": ROOT}
        for r in range(args.ab_rounds):
            for side in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                out = Path(tmp) / f"{side}_{r}.json"
                subprocess.run([sys.executable, str(Path(__file__).resolve()), *child, "--out", str(out)],
                               cwd=trees[side], env={**os.environ, "PYTHONPATH": str(trees[side])}, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                summary = json.loads(out.read_text())["summary"]
                for key, value in summary.items():
                    ttft[side].setdefault(key, []).append(value)
                print(f"round {r} {side}: {summary}", flush=True)
    summary = {}
    for key in ttft["tree"]:
        base, tree = statistics.median(ttft["base"][key]), statistics.median(ttft["tree"][key])
        summary.update({f"base_{key}": base, f"tree_{key}": tree,
                        f"speedup_{key.removesuffix('_ttft_ms')}": round(base / tree, 3)})
    print(summary)
    result = {"bench": "prefill_ttft_ab", "summary": summary, "ttft_ms": ttft, "config": vars(args), **run_info(argv)}
    if args.out:
        write_result_file(args.out, result)
    return result


def main(argv: list[str] | None = None) -> dict:
    from dspark import kernels
    from dspark.bench.datasets import load_prompts
    from dspark.engine.build import resolve_matmul_dtype
    from dspark.llm import LLM
    from dspark.models.loader import DEFAULT_MODEL
    from dspark.sampling import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--matmul-dtypes", default="float32,auto")
    p.add_argument("--lengths", default="128,512", help="prompt lengths in tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention-tiles", default=None, help="comma list of CPU attention tile sizes to alternate")
    p.add_argument("--base", default=None, help="git revision to compare the working tree with")
    p.add_argument("--ab-rounds", type=int, default=3, help="with --base: child processes per side")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.base:
        return compare_revision(args, argv)
    dtypes = list(dict.fromkeys(resolve_matmul_dtype(d, model=DEFAULT_MODEL) for d in args.matmul_dtypes.split(",")))
    lengths = [int(n) for n in args.lengths.split(",")]
    engines = {d: LLM(speculative_config=None, max_num_seqs=1, matmul_dtype=d) for d in dtypes}
    tok = next(iter(engines.values())).tokenizer
    text = " ".join(r.prompt for r in load_prompts("all", num_prompts=40, seed=0))
    ids = tok.encode(text)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ops = kernels.ops()
    if args.attention_tiles and ops is None:
        p.error("--attention-tiles: the CPU kernels are unavailable")
    tiles = [int(t) for t in args.attention_tiles.split(",")] if args.attention_tiles else [None]
    times: dict[tuple[str, int, int | None], list[float]] = {(d, n, t): [] for d in dtypes for n in lengths
                                                              for t in tiles}
    for r in range(args.rounds + 1):  # round 0 warms up
        for i, n in enumerate(lengths):
            for j, t in enumerate(tiles):
                prompt = ids[((r * len(lengths) + i) * len(tiles) + j) * 7:][:n]  # another cut: no prefix-cache hit
                before = ops.set_attention_tile(t) if t else None
                try:
                    for d, llm in engines.items():
                        out = llm.generate([prompt], params)[0]
                        if r:
                            times[(d, n, t)].append(out.ttft_s * 1e3)
                finally:
                    if t:
                        ops.set_attention_tile(before)
    rows = [{"matmul_dtype": d, "prompt_tokens": n, "attention_tile": t, "ttft_ms": statistics.median(v),
             "ttft_ms_all": v} for (d, n, t), v in times.items()]
    for row in rows:
        tile = f" tile {row['attention_tile']:2d}" if row["attention_tile"] else ""
        print(f"{row['matmul_dtype']:>8s} {row['prompt_tokens']:5d} tokens{tile}: {row['ttft_ms']:8.1f} ms")
    summary = {f"{row['matmul_dtype']}_{row['prompt_tokens']}"
               f"{'_tile%d' % row['attention_tile'] if row['attention_tile'] else ''}_ttft_ms": round(row["ttft_ms"], 1)
               for row in rows}
    result = {"bench": "prefill_ttft", "summary": summary, "rows": rows, **run_info(argv)}
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
