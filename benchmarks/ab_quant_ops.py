"""The block products (cpu_ops_blocks.inc: Q5_0, Q4_K, Q6_K, and the Q8_0 head's q8_0_mm) of a git revision
against the working tree's, side by side in one process on gemma-3-270m's own layer matrices and head, as a
decode step meets them: every matrix of a type once per sweep, so the weights come from memory, not from a
cache a repeated call would warm (a product timed alone on one matrix measures another thing). The builds alternate sweep by sweep; median ms per sweep
and the ratio, for 1 input row (decode) and 5 (an n-gram γ 4 verification). The two builds' outputs are
checked equal bit for bit on every matrix first. `--model` takes another GGUF file's layer matrices (the head
row is gemma-3-270m's only).

    python benchmarks/ab_quant_ops.py --base 4d1e6eb --out benchmarks/results/ab_quant_ops_head_prefetch.json
    python benchmarks/ab_quant_ops.py --base 42eb018 --threads 2 --rows 1,4 \
        --model ~/.cache/dspark/shapes/qwen3-1.7b-Q4_K_M.gguf --out benchmarks/results/ab_kquant_rows_512.json
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

TYPES = {6: "Q5_0", 12: "Q4_K", 14: "Q6_K", 8: "Q8_0 head"}  # the head: q8_0_mm on the tied embedding's rows


def product(build, t: int, x: torch.Tensor, w) -> torch.Tensor:
    """`w`: the head's rows as {layout: tensor}, each build reading its own (interleaved by 8 or plain); Q4_K
    rows as {"packed": ..., "file": ...}, packed by 16 for a build that reads them (`ggml.pack_k16`)."""
    if t == 8:
        return build.q8_0_mm(x, w["x8" if getattr(build, "q8_0_interleaved", False) else "plain"])
    if isinstance(w, dict):
        from dspark.kernels.ggml import Q4_KX16
        packed = getattr(build, "k_quant_group_rows", 0) == 16
        return build.block_mm(x, w["packed"], Q4_KX16) if packed else build.block_mm(x, w["file"], t)
    return build.block_mm(x, w, t)


def head_layouts() -> dict[str, torch.Tensor]:
    """gemma-3-270m's tied head rows interleaved by 8 (`blocks.pack_q8_0x8`) and in the plain packing
    (`blocks.pack_q8_0`) that earlier builds read."""
    from bench_q8_0_head import head_rows
    from dspark.kernels.blocks import pack_q8_0, pack_q8_0x8
    raw, _ = head_rows("gemma-3-270m")
    return {"x8": pack_q8_0x8(raw), "plain": pack_q8_0(raw)}


def main() -> None:
    from kernel_revision import build_quant_revision
    from dspark.bench.report import run_info, write_result_file
    from dspark.kernels import ggml
    from dspark.models.layers import Linear
    from dspark.models.loader import load_model
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision whose block products are the baseline")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--sweeps", type=int, default=20)
    ap.add_argument("--model", default="gemma-3-270m", help="a model name or GGUF file whose layers are timed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    builds = {"base": build_quant_revision(args.base), "tree": ggml.ops()}
    if builds["tree"] is None:
        raise SystemExit("the working tree's block kernels are unavailable")
    model, _, _ = load_model(args.model, matmul_dtype="gguf")
    parts = [(t, w, m.in_features) for m in model.modules() if isinstance(m, Linear)
             for t, w in m.blocks.parts if t in TYPES and t != 8]
    parts += [(12, {"packed": w, "file": ggml.unpack_k16(w)}, m.in_features) for m in model.modules()
              if isinstance(m, Linear) for t, w in m.blocks.parts if t == ggml.Q4_KX16]
    types = dict(TYPES)
    if args.model == "gemma-3-270m":
        parts += [(8, head_layouts(), model.config.hidden_size)]
    else:
        types.pop(8)
    types = {t: label for t, label in types.items() if any(t == pt for pt, _, _ in parts)}
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=torch.Generator().manual_seed(k)) for k in {k for _, _, k in parts}}
        for t, w, k in parts:
            if not torch.equal(product(builds["base"], t, xs[k], w), product(builds["tree"], t, xs[k], w)):
                raise SystemExit(f"{TYPES[t]}, {m} rows: the builds' outputs differ")
        times = {(name, t): [] for name in builds for t in types}
        for _ in range(args.sweeps):
            for name, build in builds.items():
                for qtype in types:
                    t0 = time.perf_counter()
                    for t, w, k in parts:
                        if t == qtype:
                            product(build, t, xs[k], w)
                    times[(name, qtype)].append(time.perf_counter() - t0)
        for qtype, label in types.items():
            mine = [w["x8"] if t == 8 else w["file"] if isinstance(w, dict) else w for t, w, _ in parts if t == qtype]
            med = {name: statistics.median(times[(name, qtype)]) * 1e3 for name in builds}
            results.append({"type": label, "rows": m, "matrices": len(mine),
                            "mbytes": sum(w.numel() for w in mine) / 1e6, "median_ms_per_sweep": med,
                            "base_over_tree": med["base"] / med["tree"]})
            print(f"{label} ({len(mine)} matrices), {m} rows: base {med['base']:.2f} ms, tree {med['tree']:.2f} ms "
                  f"({med['base'] / med['tree']:.2f}x)", flush=True)
    result = {"benchmark": "ab_quant_ops", "base": args.base, "model": str(args.model),
              "threads": torch.get_num_threads(), "equal_outputs": True, "results": results, **run_info()}
    if args.out:
        write_result_file(args.out, result)


if __name__ == "__main__":
    main()
