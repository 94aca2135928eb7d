"""The block products (quant_ops.cpp: Q5_0, Q4_K, Q6_K, and the LM head's Q8_0 x Q8_0) of a git revision
against the working tree's, side by side in one process on gemma-3-270m's shapes, calls alternating (a slow
phase of the machine hits both alike): median ms per call and the ratio, for 1 input row (decode) and 5
(an n-gram γ 4 verification). Both builds must give the same outputs bit for bit where the revision has the
product (checked on every shape).

    python benchmarks/ab_quant_ops.py --base 577ea14 --out benchmarks/results/ab_quant_ops_gemma.json
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

# (label, GGML type, N, K): gemma-3-270m's layer products (q|k, gate|up, o, down)
SHAPES = [("q|k Q5_0", 6, 1280, 640), ("gate|up Q5_0", 6, 4096, 640), ("o Q4_K", 12, 640, 1024),
          ("down Q4_K", 12, 640, 2048), ("down Q6_K", 14, 640, 2048)]


def random_rows(qtype: int, n: int, k: int) -> torch.Tensor:
    """Random GGUF rows of `qtype` with sane fp16 scales (the tests' generator)."""
    from tests.test_gguf_blocks import gguf_rows
    import gguf
    return gguf_rows(n, k, gguf.GGMLQuantizationType(qtype), seed=n + k)


def main() -> None:
    from kernel_revision import build_quant_revision
    from dspark.bench.report import run_info, write_result_file
    from dspark.kernels import ggml
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision whose quant_ops.cpp is the baseline")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    builds = {"base": build_quant_revision(args.base), "tree": ggml.ops()}
    if builds["tree"] is None:
        raise SystemExit("the working tree's block kernels are unavailable")
    results = []
    for label, qtype, n, k in SHAPES:
        raw = random_rows(qtype, n, k)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            outs = {name: b.block_mm(x, raw, qtype) for name, b in builds.items()}
            if not torch.equal(outs["base"], outs["tree"]):
                raise SystemExit(f"{label}, {m} rows: the builds' outputs differ")
            times: dict[str, list[float]] = {name: [] for name in builds}
            for _ in range(args.calls):
                for name, b in builds.items():
                    t0 = time.perf_counter()
                    b.block_mm(x, raw, qtype)
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            results.append({"product": label, "rows": m, "N": n, "K": k, "median_ms": med,
                            "base_over_tree": med["base"] / med["tree"]})
            print(f"{label} {n}x{k}, {m} rows: base {med['base']:.3f} ms, tree {med['tree']:.3f} ms "
                  f"({med['base'] / med['tree']:.2f}x)", flush=True)
    result = {"benchmark": "ab_quant_ops", "base": args.base, "threads": torch.get_num_threads(),
              "equal_outputs": True, "results": results, **run_info()}
    if args.out:
        write_result_file(args.out, result)


if __name__ == "__main__":
    main()
