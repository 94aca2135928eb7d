"""The DSpark drafter's proposal (block forward, Markov head, confidences) against the number of
requests, drafter paths side by side in one process: each round times every path at every request
count once, each proposal right after a target verification step (so the drafter's weights come from
memory, as in serving, not from the cache of the previous proposal); medians over rounds.

    python benchmarks/bench_draft_proposal.py --num-reqs 1,4,16,32,64 --rounds 7 \
        --out benchmarks/results/draft_proposal.json

Paths: `current` (the defaults: `draft_matmul_dtype` auto — Q4_1 blocks where the kernels multiply them — and
the greedy proposal in one kernel call, `DSparkModel.fused_proposal`), `bf16` (`draft_matmul_dtype` "bfloat16":
bf16 copies, widened against the fp32 input on AVX2, op by op over the fused decoder stack), `module-bf16` (bf16
products, the block forward through the per-layer modules) and `module-fp32` (fp32 products and the modules: the
drafter path before the fused stack), `q4_1` (`draft_matmul_dtype` "q4_1", as `current`), and `kernel-rows-128`
(bf16 products of up to 128 rows through the kernel instead of `kernels.bf16_kernel_rows()`: 16 on CPUs with AMX,
where torch's oneDNN products are faster past that),
`topk-K` (the defaults with top-K Markov drafting, spec "draft_topk": K), `markov-loop` (the defaults with the greedy
Markov walk position by position in Python instead of one `kernels.markov_walk` call); `NAME=FOLDER` is another
drafter folder (an export of `dspark train`) with the defaults. The target is the default model at `auto` (q4_1 on AVX2
CPUs), context 256 positions per request (`dspark profile`'s `StepProfiler`).
"""

from __future__ import annotations

import argparse
import statistics
import time

from dspark.bench.report import run_info, write_result_file

DRAFTER = "dspark/assets/drafters/dspark-smollm2-135m"
PATHS = {"current": {}, "bf16": {"draft_matmul_dtype": "bfloat16"},
         "module-bf16": {"fused": False, "draft_matmul_dtype": "bfloat16"},
         "module-fp32": {"fused": False, "draft_matmul_dtype": "float32"},
         "q4_1": {"draft_matmul_dtype": "q4_1"},
         "kernel-rows-128": {"bf16_kernel_rows": 128, "draft_matmul_dtype": "bfloat16"},
         "markov-loop": {"markov_loop": True}, "topk-4": {"draft_topk": 4}, "topk-8": {"draft_topk": 8}, "topk-16": {"draft_topk": 16}}


def main(argv: list[str] | None = None) -> dict:
    from dspark import kernels
    from dspark.llm import LLM
    from dspark.engine.step_profiler import StepProfiler

    p = argparse.ArgumentParser()
    p.add_argument("--num-reqs", default="1,4,16,32,64")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    counts = [int(n) for n in args.num_reqs.split(",")]
    profilers, kernel_rows = {}, {}
    for path in args.paths.split(","):
        name, _, folder = path.partition("=")
        opts = {"model": folder} if folder else dict(PATHS[name])
        fused = opts.pop("fused", True)
        kernel_rows[name] = opts.pop("bf16_kernel_rows", None)
        markov_loop = opts.pop("markov_loop", False)
        llm = LLM(speculative_config={"method": "dspark", "model": DRAFTER, **opts})
        if markov_loop:
            llm.engine.drafter._walks_in_kernel = lambda head: False
        if not fused:
            llm.engine.drafter.model.fused_backbone = lambda *a, **k: None  # the module path
            llm.engine.drafter._fused_proposal = lambda batch: None
        profilers[name] = StepProfiler(llm.engine)
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in profilers for n in counts}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n in counts:
            for name, prof in profilers.items():
                prof.windows_step([8])  # a target step in between, as in serving
                kernels.BF16_KERNEL_ROWS = kernel_rows[name]
                start = time.perf_counter()
                prof.draft_step(n)
                if r:
                    times[(name, n)].append(time.perf_counter() - start)
    kernels.BF16_KERNEL_ROWS = None
    ms = {f"{name}_r{n}_ms": round(statistics.median(t) * 1e3, 2) for (name, n), t in times.items()}
    base = next(iter(profilers))
    ratios = {f"{name}_over_{base}_r{n}": round(ms[f"{name}_r{n}_ms"] / ms[f"{base}_r{n}_ms"], 2)
              for name in profilers if name != base for n in counts}
    result = {"bench": "draft_proposal", "summary": {**ms, **ratios}, "config": vars(args),
              "samples_ms": {f"{name}_r{n}": [round(x * 1e3, 3) for x in t] for (name, n), t in times.items()},
              **run_info(argv)}
    for n in counts:
        print(f"{n:3d} requests: " + "  ".join(f"{name} {ms[f'{name}_r{n}_ms']:.1f} ms" for name in profilers))
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
