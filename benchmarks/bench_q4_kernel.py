"""Q4_1 products side by side in one process: the kernels (and packer) of a git revision against the working
tree's, on the four matrix products of a SmolLM2-135M decoder layer (qkv 576→960, o 576→576, gate_up
576→3072, down 1536→576) at the row counts of decode, verification and prompt steps, in rounds (every
row count with both kernels once per round; medians over rounds), so a slow phase of the machine hits
both alike.

    python benchmarks/bench_q4_kernel.py --base fb92dc4 --out benchmarks/results/q4_kernel.json

The revision's kernels (`cpu_ops.cpp` and its parts: kernel_revision.py) are built under another module name (cached beside the working tree's
build) and its `pack_q4_1` is read from its own `dspark/kernels/__init__.py`, so the two may pack
differently. The weights are the same random matrix quantized by gguf; each kernel multiplies its own
packing of those blocks. By default each of the 30 layers has its own copy, so a step streams its ~66 MB
of weights from memory as a decode step does; `--in-cache` times one layer's products repeated (its 2 MB
stay in cache: its tile pairs measured that way on an AVX512-VNNI EPYC, 2026-12-02, ran 1.16-1.45x faster at 2-8 rows, while the whole
decoder stack ran them 1.3-1.6x slower than single tiles). Reported: ms for the 30 layers of a step (and a
layer's share), and base ÷ new.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from dspark.bench.report import run_info, write_result_file
from kernel_revision import build_revision

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
NUM_LAYERS = 30


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout


def base_kernels(rev: str):
    """(ops module, its packer) of git revision `rev`."""
    ops = build_revision(rev)
    with tempfile.TemporaryDirectory() as tmp:  # the revision's packer (its module is never built)
        path = Path(tmp) / "dspark_kernels_base.py"
        path.write_text(_git_show(rev, "dspark/kernels/__init__.py"))
        spec = importlib.util.spec_from_file_location("dspark_kernels_base", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if "group_rows" not in inspect.signature(module.pack_q4_1).parameters:  # before the 16-row groups
        return ops, module.pack_q4_1
    # the layout that revision's kernels read (its packer would ask its own, never built, module)
    return ops, functools.partial(module.pack_q4_1, group_rows=int(getattr(ops, "q4_1_group_rows", 8)))


def time_step(ops, layers: list[dict], xs: dict, *, reps: int) -> float:
    """Seconds for the four products of every layer in `layers` at one row count, layer after layer as a
    step runs them (mean of `reps`, after one warm pass)."""
    def step():
        for packed in layers:
            for name, w in packed.items():
                ops.small_mm(xs[name], w)
    step()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose Q4_1 kernels to compare against")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="input row counts, comma list")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--in-cache", action="store_true",
                    help="repeat one layer's weights (they stay in cache) instead of 30 layers' own copies")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dspark import kernels
    if not kernels.has_q4_1_kernels():
        raise SystemExit("this CPU has no Q4_1 kernels (AVX2 + FMA + F16C)")
    base_ops, base_pack = base_kernels(args.base)
    raw = {}
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        w = np.random.default_rng(i).standard_normal((n, k)).astype(np.float32) * 0.05
        raw[name] = torch.from_numpy(np.ascontiguousarray(gguf.quantize(w, gguf.GGMLQuantizationType.Q4_1)))
    def layers(pack) -> list[dict]:  # NUM_LAYERS layers: one packing repeated (--in-cache) or each its own copy
        one = {n: pack(r) for n, r in raw.items()}
        return [one if args.in_cache or i == 0 else {n: w.clone() for n, w in one.items()} for i in range(NUM_LAYERS)]
    variants = {"base": (base_ops, layers(base_pack)), "new": (kernels.ops(), layers(kernels.pack_q4_1))}
    gen = torch.Generator().manual_seed(0)
    row_counts = [int(r) for r in args.rows.split(",")]
    inputs = {rows: {n: torch.randn(rows, k, generator=gen) for n, (_, k) in SHAPES.items()} for rows in row_counts}
    # the same blocks and inputs: are the two kernels' products bit for bit the same? (they are where only the
    # instructions differ, e.g. VNNI against AVX2 integer sums; not where the product's model changed)
    bitwise = {rows: all(torch.equal(base_ops.small_mm(inputs[rows][n], variants["base"][1][0][n]),
                                     kernels.ops().small_mm(inputs[rows][n], variants["new"][1][0][n])) for n in SHAPES)
               for rows in row_counts}
    seconds = {(v, rows): [] for v in variants for rows in row_counts}
    for r in range(args.rounds):
        for rows in row_counts:
            order = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for v in order:
                ops, packed = variants[v]
                seconds[(v, rows)].append(time_step(ops, packed, inputs[rows], reps=max(2, 16 // rows)))
    table = []
    for rows in row_counts:
        base = statistics.median(seconds[("base", rows)])
        new = statistics.median(seconds[("new", rows)])
        table.append({"rows": rows, "base_layer_ms": round(base / NUM_LAYERS * 1e3, 4),
                      "new_layer_ms": round(new / NUM_LAYERS * 1e3, 4), "base_step_ms": round(base * 1e3, 2),
                      "new_step_ms": round(new * 1e3, 2), "base_over_new": round(base / new, 3),
                      "bitwise_equal": bitwise[rows]})
        print(f"{rows:4d} rows: base {base * 1e3:7.2f} ms  new {new * 1e3:7.2f} ms a step  ({base / new:.2f}x)"
              f"  {'bitwise equal' if bitwise[rows] else 'products differ'}")
    result = {"bench": "q4_kernel", "base": args.base, "rounds": args.rounds, "threads": torch.get_num_threads(),
              "q4_1_vnni": {"base": bool(getattr(base_ops, "q4_1_vnni", False)),
                            "new": bool(getattr(kernels.ops(), "q4_1_vnni", False))},
              "weights": "one layer repeated (in cache)" if args.in_cache else "each layer its own copy (streamed)",
              "shapes": SHAPES, "num_layers": NUM_LAYERS, "table": table, **run_info()}
    if args.out:
        write_result_file(args.out, result)


if __name__ == "__main__":
    main()
