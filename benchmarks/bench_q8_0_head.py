"""The LM head of a Q8_0 embedding (gemma-3-270m's tied 262144 x 640 rows, or with --model default SmolLM2's
49152 x 576): the products on the same rows, side by side in one process, alternating call by call — the fp32
input (cpu_ops' `small_mm`, the exact product of the file's weights), the input quantized to Q8_0 blocks with
integer sums (cpu_ops' `q8_0_mm` on the rows interleaved by `blocks.pack_q8_0x8`, llama.cpp's Q8_0 x Q8_0, what
a resident head runs) and, on a CPU with bf16 dot products, the bf16 rounding of the rows. Median milliseconds
per call per input-row count, the ratios, and the bytes read per second.

    python benchmarks/bench_q8_0_head.py --threads 1 --out benchmarks/results/q8_0_head_gemma.json
    python benchmarks/bench_q8_0_head.py --model default --threads 1 --out benchmarks/results/q8_0_head_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def head_rows(model: str) -> tuple[torch.Tensor, str]:
    """The model's Q8_0 embedding rows (GGUF blocks) when installed, else random blocks of gemma-3-270m's shape."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    try:
        from dspark.models.blocks import gguf_rows
        from dspark.models.gguf_format import gguf_reader
        from dspark.models.loader import resolve_model_path
        reader = gguf_reader(resolve_model_path(model))
        tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
        qtype, raw = gguf_rows(tensor)
        if qtype != 8:
            raise SystemExit(f"{model}: token_embd.weight is GGML type {qtype}, not Q8_0")
        return raw, f"{model} token_embd.weight (Q8_0)"
    except (FileNotFoundError, StopIteration):
        g = torch.Generator().manual_seed(0)
        raw = torch.randint(0, 256, (262144, 20, 34), dtype=torch.uint8, generator=g)
        raw[..., :2] = torch.tensor([0x1F, 0x24], dtype=torch.uint8)  # d = 0.0101 (fp16)
        return raw.reshape(262144, -1), "random Q8_0 blocks, 262144 x 640"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m", help="a GGUF whose embedding is Q8_0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,5,8", help="input rows per call (decode: 1; verification: 1 + drafts)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dspark import kernels
    from dspark.bench.report import run_info, write_result_file
    from dspark.kernels import ggml
    if kernels.ops() is None or ggml.ops() is None:
        raise SystemExit("the CPU kernels are not built (python -m dspark.kernels)")
    raw, source = head_rows(args.model)
    packed, interleaved = kernels.pack_q8_0(raw), kernels.blocks.pack_q8_0x8(raw)
    hidden = kernels.blocks.q8_0_packed_cols(packed)
    products = {"fp32_input": lambda x: kernels.ops().small_mm(x, packed),
                "q8_0_input": lambda x: ggml.q8_0_product(x, interleaved)}
    if kernels.has_bf16_kernels():
        rows_bf16 = kernels.blocks.q8_0_packed_values(packed).to(torch.bfloat16)
        products["bf16"] = lambda x: kernels.linear(x, rows_bf16)
    results = {}
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, hidden, generator=torch.Generator().manual_seed(m))
        times: dict[str, list[float]] = {k: [] for k in products}
        for _ in range(args.repeats + 1):  # the first call of each warms up and is dropped
            for name, f in products.items():
                t0 = time.perf_counter()
                f(x)
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
        results[str(m)] = {"median_ms": med, "fp32_over_q8_0": med["fp32_input"] / med["q8_0_input"],
                           "q8_0_input_gb_s": packed.numel() / (med["q8_0_input"] / 1e3) / 1e9}
        if "bf16" in med:
            results[str(m)]["bf16_over_q8_0"] = med["bf16"] / med["q8_0_input"]
        print(f"rows {m}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()), flush=True)
    result = {"benchmark": "q8_0_head", "rows_source": source, "shape": list(packed.shape),
              "threads": torch.get_num_threads(), "results": results, **run_info()}
    if args.out:
        write_result_file(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
