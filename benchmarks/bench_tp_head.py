"""The tensor-parallel head on greedy decode steps: the ranks' vocabulary slices of the logits gathered to rank 0
("rows") against each rank's (max, argmax) per row merged there ("argmax", dspark.distributed.vocab_argmax).

One TP = 2 engine (gloo, two processes) on the default model (SmolLM2-135M, vocabulary 49,152: slices of
24,576 logits), plain greedy decoding at batch 1 and 32; within each batch the two heads alternate in
blocks of steps on the same running requests (the runner's `head_argmax` flipped between blocks, in ABBA
order), so both see the same machine load and context lengths. Per decode step: the bytes rank 0 received by the head's
gather and the bytes all-reduced (the same for both heads), the seconds rank 0 spent in the head's gather
(it includes waiting for the slower rank) and the whole step's seconds; medians, rows ÷ argmax of the
medians, and the median over blocks of each block pair's ratio of mean step seconds.

    OMP_NUM_THREADS=1 python benchmarks/bench_tp_head.py --out benchmarks/results/tp_head_tp2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from dspark.config import DEFAULT_MODEL, EngineConfig, ParallelConfig, SchedulerConfig
from dspark.engine.build import build_engine
from dspark.sampling import SamplingParams


def measure(engine, tp, *, batch: int, blocks: int, steps: int) -> dict:
    """Decode `batch` requests; `blocks` rounds of `steps` steps with each head in turn."""
    params = SamplingParams(temperature=0.0, max_tokens=4 * blocks * steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request([1 + (7 * i + j) % 4000 for j in range(16)], params)
    for _ in range(3):  # the prompts (one step within the budget) and two decode steps
        engine.step()
    head_s = [0.0]
    gather = tp.gather_cat

    def timed(x):
        start = time.perf_counter()
        out = gather(x)
        head_s[0] += time.perf_counter() - start
        return out

    tp.gather_cat = timed
    per: dict[str, dict[str, list]] = {h: {"step_s": [], "head_gather_s": [], "gathered_bytes": [],
                                            "all_reduced_bytes": []} for h in ("rows", "argmax")}
    try:
        for block in range(blocks):
            for head in ("argmax", "rows") if block % 2 == 0 else ("rows", "argmax"):  # ABBA: no order bias
                engine.runner.head_argmax = head == "argmax"
                for _ in range(steps):
                    g, r, head_s[0] = tp.gathered_bytes, tp.reduced_bytes, 0.0
                    start = time.perf_counter()
                    outs = engine.step()
                    per[head]["step_s"].append(time.perf_counter() - start)
                    per[head]["head_gather_s"].append(head_s[0])
                    per[head]["gathered_bytes"].append(tp.gathered_bytes - g)
                    per[head]["all_reduced_bytes"].append(tp.reduced_bytes - r)
                    assert sum(len(o.new_token_ids) for o in outs) == batch
    finally:
        tp.gather_cat = gather
        engine.runner.head_argmax = True
    for rid in list(engine.requests):  # released at once
        engine.abort(rid)
    out = {head: {f"{k}_median": statistics.median(v) for k, v in m.items()} | {"steps": len(m["step_s"])}
           for head, m in per.items()}
    rows, arg = out["rows"], out["argmax"]
    out["rows_over_argmax"] = {k: rows[f"{k}_median"] / max(arg[f"{k}_median"], 1e-12)
                               for k in ("step_s", "head_gather_s", "gathered_bytes")}
    # the load drifts: the median over blocks of each block's rows ÷ argmax (mean step seconds)
    block_means = {h: [statistics.fmean(per[h]["step_s"][i:i + steps]) for i in range(0, blocks * steps, steps)]
                   for h in per}
    out["rows_over_argmax"]["step_s_median_of_block_ratios"] = statistics.median(
        r / a for r, a in zip(block_means["rows"], block_means["argmax"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    wall = time.perf_counter()
    config = EngineConfig(model=args.model, device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=32, coalesce_steps=0),
                          parallel=ParallelConfig(tensor_parallel_size=2))
    engine, _ = build_engine(config)
    tp = engine.runner.model.tp
    try:
        results = {f"batch_{b}": measure(engine, tp, batch=b, blocks=args.blocks, steps=args.steps)
                   for b in (1, 32)}
    finally:
        engine.workers.close()
    summary = {"bench": "tp_head", "date": time.strftime("%Y-%m-%d"), "model": args.model,
               "vocab_size": engine.model_config.vocab_size, "tensor_parallel_size": 2,
               "machine": "2-vCPU Xeon, shared", "platform": platform.platform(),
               "command": "OMP_NUM_THREADS=1 python benchmarks/bench_tp_head.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                   if v is not None and k != "model"),
               "wall_s": round(time.perf_counter() - wall, 1), **results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
