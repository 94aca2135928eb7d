"""Speculation priced at a published shape from measured step costs: the quantized target (a GGUF of
gguf_shapes.py, random weights, loaded as `dspark serve` would: `--matmul-dtype auto`) times one verification
window of k tokens at batch 1 after a 256-token context (k = 1, 2, 4, 8: `StepProfiler.verify_step`, medians),
its LM head alone on k rows, and from those a drafter's proposal: a one-layer MTP head drafting γ tokens one at a
time (γ × (one layer + the head) at one row) and a two-layer DSpark block (two layers over γ + 1 rows + the head
over γ rows, one call). Then per drafter and γ the tokens per step τ that break even,
τ* = (c(γ + 1) + draft(γ)) / c(1), and the speed-up τ c(1) / (c(γ + 1) + draft(γ)) at the accepted lengths the
DSpark paper publishes for Qwen3-4B at γ = 7 (dspark-reference.md §10: DSpark macro 4.73, chat 3.49; EAGLE-3
macro 3.61). Layer cost = (c(k) - head(k)) / layers.

    python benchmarks/bench_shape_speculation.py --shape qwen3-4b --type Q4_K_M --llama-bin /work/llbuild/bin \
        --out benchmarks/results/shape_speculation_qwen3_4b.json
    python benchmarks/bench_shape_speculation.py --shape qwen3.5-2b --type Q4_K_M --llama-bin /work/llbuild/bin \
        --out benchmarks/results/shape_speculation_qwen3.5_2b.json

On a hybrid (Qwen3.5) a layer's cost is the mean over its linear-attention and full-attention layers, and a
verification window keeps every position's recurrent state (the rollback a rejection needs), which c(k) includes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PUBLISHED_TAU = {"DSpark macro (Qwen3-4B)": 4.727, "DSpark chat (Qwen3-4B)": 3.49, "EAGLE-3 macro (Qwen3-4B)": 3.611}


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    from gguf_shapes_hf import SHAPES as HF_SHAPES, make
    from gguf_shapes import SHAPES
    from dspark import LLM
    from dspark.bench.report import run_info, write_result_file
    from dspark.engine.step_profiler import StepProfiler
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", choices=sorted({*SHAPES, *HF_SHAPES}))
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/dspark/shapes")
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder of llama-quantize")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = make(args.shape, [args.type], args.dir, args.llama_bin / "llama-quantize")[args.type]
    llm = LLM(str(path), max_model_len=1024, max_num_seqs=1)
    engine = llm.engine
    model = engine.runner.model
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    prof = StepProfiler(engine, context_len=256, tokens_per_request=8)
    step = {k: _median_s(lambda k=k: prof.verify_step(k), args.reps) for k in (1, 2, 4, 8)}
    prof.close()
    with torch.inference_mode():
        head = {k: _median_s(lambda k=k: model.compute_logits(torch.randn(k, hidden)), args.reps) for k in (1, 7, 8)}
    layer = {k: max(0.0, step[k] - head[k]) / layers for k in (1, 8)}
    drafts = {"MTP (1 layer, sequential)": lambda g: g * (layer[1] + head[1]),
              "DSpark (2 layers, one block)": lambda g: 2 * layer[8] + head[7]}
    rows = []
    for name, cost in drafts.items():
        g = 7
        total = step[8] + cost(g)
        row = {"drafter": name, "gamma": g, "verify_s": step[8], "draft_s": cost(g), "break_even_tau": total / step[1],
               "speedup_at": {label: tau * step[1] / total for label, tau in PUBLISHED_TAU.items()}}
        rows.append(row)
        print(f"{args.shape} {args.type} {name}, γ={g}: c(1) {step[1] * 1e3:.0f} ms, c(8) {step[8] * 1e3:.0f} ms, "
              f"draft {cost(g) * 1e3:.0f} ms, break-even τ {row['break_even_tau']:.2f}; "
              + ", ".join(f"{k} τ={PUBLISHED_TAU[k]}: {v:.2f}x" for k, v in row["speedup_at"].items()), flush=True)
    result = {"benchmark": "shape_speculation", "shape": args.shape, "type": args.type, "file": str(path),
              "step_s": step, "head_s": head, "layer_s": layer, "rows": rows, "published_tau": PUBLISHED_TAU,
              "threads": torch.get_num_threads(), **run_info()}
    if args.out:
        write_result_file(args.out, result)


if __name__ == "__main__":
    main()
