"""Top-K Markov drafting (spec "draft_topk") against the full Markov head: the shipped DSpark drafter's whole
proposal (block forward, head loop, confidences) at each K, interleaved in one process, one torch thread,
timed in thread CPU time (`time.thread_time`) as well as wall time, so that other processes sharing the
cores inflate neither much; medians over rounds, each proposal after a target verification step.

    python benchmarks/bench_draft_topk.py --num-reqs 1,4 --topk 0,8,16,32 --rounds 40 \
        --out benchmarks/results/draft_topk_proposal.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from dspark.bench.report import run_info, write_result_file

DRAFTER = "dspark/assets/drafters/dspark-smollm2-135m"


def main(argv: list[str] | None = None) -> dict:
    import torch

    from dspark.llm import LLM
    from dspark.engine.step_profiler import StepProfiler

    p = argparse.ArgumentParser()
    p.add_argument("--num-reqs", default="1,4")
    p.add_argument("--topk", default="0,8,16,32")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    counts, ks = [int(n) for n in args.num_reqs.split(",")], [int(k) for k in args.topk.split(",")]
    llm = LLM(speculative_config={"method": "dspark", "model": DRAFTER}, num_threads=1)
    prof, drafter = StepProfiler(llm.engine), llm.engine.drafter
    cpu = {(k, n): [] for k in ks for n in counts}
    wall = {(k, n): [] for k in ks for n in counts}
    for r in range(args.rounds + 2):  # two warm-up rounds
        for n in counts:
            for k in ks:
                prof.windows_step([8])
                drafter.draft_topk = k
                c0, w0 = time.thread_time(), time.perf_counter()
                prof.draft_step(n)
                if r >= 2:
                    cpu[(k, n)].append(time.thread_time() - c0)
                    wall[(k, n)].append(time.perf_counter() - w0)
    summary = {}
    for n in counts:
        for k in ks:
            summary[f"k{k}_r{n}_cpu_ms"] = round(statistics.median(cpu[(k, n)]) * 1e3, 3)
            summary[f"k{k}_r{n}_wall_ms"] = round(statistics.median(wall[(k, n)]) * 1e3, 3)
        for k in ks[1:]:
            summary[f"k{k}_over_k{ks[0]}_r{n}_cpu"] = round(summary[f"k{k}_r{n}_cpu_ms"] / summary[f"k{ks[0]}_r{n}_cpu_ms"], 3)
        line = "  ".join(f"K={k} {summary[f'k{k}_r{n}_cpu_ms']:.2f} ms" for k in ks)
        print(f"{n:3d} requests (thread CPU): {line}")
    result = {"bench": "draft_topk_proposal", "summary": summary, "config": vars(args), **run_info(argv)}
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
