"""A kernel change, side by side in one process: the CPU kernels of a git revision against the working
tree's, on the same engine and the same verification-step shapes, in rounds (every shape with both
kernels once per round, medians over rounds), so a slow phase of the machine hits both alike.

    python benchmarks/ab_kernels.py --base 734ca1d --out benchmarks/results/ab_kernels_attention.json

The revision's kernels (`dspark/kernels/cpu_ops.cpp` and its parts: kernel_revision.py) are built under another module name (once, cached beside the
working tree's build) and swapped in through `dspark.kernels.ops`; the Python side stays the working
tree's, so the revision's source must keep the same op signatures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.bench.report import run_info, write_result_file
from kernel_revision import build_revision

SHAPES = [(1, 1), (1, 8), (8, 1), (8, 8), (16, 1), (16, 2), (16, 8), (32, 1), (32, 4)]


def main(argv: list[str] | None = None) -> dict:
    from dspark import kernels
    from dspark.llm import LLM
    from dspark.engine.step_profiler import StepProfiler

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision whose kernels are the baseline")
    p.add_argument("--matmul-dtype", default="auto", choices=["auto", "float32", "bfloat16", "q4_1"])
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shapes", default=",".join(f"{r}x{w}" for r, w in SHAPES),
                   help="comma list of REQUESTSxTOKENS step shapes (e.g. 1x128: one prompt chunk of 128 tokens)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    variants = {"base": build_revision(args.base), "tree": kernels.ops()}
    if variants["tree"] is None:
        raise SystemExit("error: the working tree's kernels are unavailable (DSPARK_CPU_KERNELS=0 or no compiler)")
    engine = LLM(speculative_config=None, max_num_seqs=64, matmul_dtype=args.matmul_dtype).engine
    profiler = StepProfiler(engine, context_len=args.context_len, tokens_per_request=max(w for _, w in shapes))
    original = kernels.ops
    times: dict[tuple[str, int, int], list[float]] = {(v, *s): [] for v in variants for s in shapes}
    try:
        with torch.inference_mode():
            for rnd in range(args.rounds + 1):  # round 0 warms up
                for num_reqs, window in shapes:
                    for name, module in variants.items():
                        kernels.ops = lambda module=module: module
                        start = time.perf_counter()
                        profiler.windows_step([window] * num_reqs)
                        if rnd:
                            times[name, num_reqs, window].append(time.perf_counter() - start)
    finally:
        kernels.ops = original
        profiler.close()
    rows = []
    for num_reqs, window in shapes:
        base, tree = (1000 * statistics.median(times[v, num_reqs, window]) for v in ("base", "tree"))
        rows.append({"num_reqs": num_reqs, "window": window, "base_ms": base, "tree_ms": tree,
                     "speedup": base / tree})
        print(f"{num_reqs:>3} requests x {window} tokens: base {base:7.1f} ms, tree {tree:7.1f} ms, "
              f"{base / tree:.2f}x")
    result = {"bench": "ab_kernels",
              "summary": {f"speedup_r{r['num_reqs']}_w{r['window']}": round(r["speedup"], 2) for r in rows},
              "config": {**vars(args), "matmul_dtype_resolved": getattr(engine.runner.model, "matmul_dtype", "float32")},
              "rows": rows, **run_info(None if argv is None else ["benchmarks/ab_kernels.py", *argv])}
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
