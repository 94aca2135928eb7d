"""Batch-1 greedy decode, side by side in one run: dspark (fp32, bf16 and Q4_1 matrix products, each where
the CPU kernels serve it; with --spec also the shipped speculative default) vs HF transformers
`generate` vs llama.cpp (llama-cpp-python, optional: F32, F16 and the shipped Q4_1 GGUF) on
SmolLM2-135M-Instruct, the same chat prompts, 128 new tokens (EOS ignored).

Reports decode tok/s (first token excluded) per engine, medians over prompts, ratios to HF and to
llama.cpp F32, and the fraction of the weight-streaming limit: weight bytes per step ÷ measured memory
bandwidth (a large tensor copy). The last stdout line is one JSON object; `--out` writes it too.

    python benchmarks/bench_decode.py --num-prompts 3 --out benchmarks/results/decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

MAX_NEW = 128


def prompts(n: int, datasets: str = "gsm8k") -> list[str]:
    """n prompts from each eval/ set in the comma list `datasets` (math and code: gsm8k,humaneval)."""
    from dspark.bench.datasets import load_prompts
    return [p.prompt for name in datasets.split(",") for p in load_prompts(name, num_prompts=n, seed=0)]


def memory_bandwidth_gbs() -> float:
    x = torch.empty(256 * 2**20 // 4, dtype=torch.float32).fill_(1.0)  # 256 MiB
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * 4 / best / 1e9  # read + write


def bench_dspark(chat_ids: list[list[int]], matmul_dtype: str = "float32", spec: bool = False) -> list[float]:
    """Decode tok/s per prompt; `spec`: the shipped speculative default (DSpark + lookup, prefix
    scheduler) on the cost table of `matmul_dtype`."""
    from dspark import LLM, SamplingParams
    from dspark.drafters.shipped import default_spec_config
    spec_config = default_spec_config("default", matmul_dtype=matmul_dtype) if spec else None
    llm = LLM(max_num_seqs=1, matmul_dtype=matmul_dtype,
              speculative_config=None if spec_config is None else dataclasses.asdict(spec_config))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    llm.generate([chat_ids[0]], SamplingParams(temperature=0, max_tokens=8))
    rates = []
    for ids in chat_ids:
        out = llm.generate([ids], params)[0]
        rates.append((len(out.token_ids) - 1) / (out.e2e_s - out.ttft_s))
    return rates


def bench_hf(chat_ids: list[list[int]]) -> list[float]:
    from transformers import AutoModelForCausalLM, TextStreamer  # noqa: F401
    from dspark.models.loader import resolve_model_path
    path = Path(resolve_model_path("default"))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    rates = []
    for ids in chat_ids:
        x = torch.tensor([ids])
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            out = model.generate(x, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
            t2 = time.perf_counter()
        n = out.shape[1] - len(ids)
        rates.append((n - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
    return rates


def bench_llama_cpp(chat_ids: list[list[int]], gguf_path: Path, repack: bool = False) -> list[float]:
    """`repack`: llama.cpp's runtime weight repacking on (its default; it segfaults on the Q4_1 GGUF on some
    AVX-512 CPUs, so that run goes through `bench_llama_cpp_child`)."""
    from dspark.bench.peers import llama_without_repack
    kwargs = dict(model_path=str(gguf_path), n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)
    if repack:
        import llama_cpp
        llm = llama_cpp.Llama(**kwargs)
    else:
        llm = llama_without_repack(**kwargs)
    rates = []
    for ids in chat_ids:
        llm.reset()
        t_first = None
        n = 0
        for _tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if n >= MAX_NEW:
                break
        rates.append((n - 1) / (time.perf_counter() - t_first))
    return rates


def bench_llama_cpp_child(chat_ids: list[list[int]], gguf_path: Path) -> list[float]:
    """bench_llama_cpp with repacking on, in a child process: [] where the child dies (the segfault)."""
    import subprocess
    code = (f"import json, sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); torch.set_num_threads("
            f"{torch.get_num_threads()}); from bench_decode import bench_llama_cpp; from pathlib import Path; "
            f"print(json.dumps(bench_llama_cpp({chat_ids!r}, Path({str(gguf_path)!r}), repack=True)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(f"llama.cpp with repacking died (exit {proc.returncode}): skipped")
        return []
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=3, help="prompts per dataset")
    ap.add_argument("--datasets", default="gsm8k", help="comma list of eval/ sets (e.g. gsm8k,humaneval)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="passes over all engines, each starting one later")
    ap.add_argument("--spec", action="store_true", help="also the shipped speculative default (fp32 and bf16)")
    ap.add_argument("--threads", type=int, default=None, help="torch/llama.cpp threads (default: torch's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dspark.models.loader import load_model, resolve_model_path
    model, cfg, tok = load_model("default")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    chat_ids = [tok.apply_chat_template([{"role": "user", "content": p}])
                for p in prompts(args.num_prompts, args.datasets)]
    del model
    runs = {"dspark_fp32": lambda: bench_dspark(chat_ids)}  # label → one pass over the prompts
    from dspark import kernels
    if kernels.has_bf16_kernels():
        runs["dspark_bf16"] = lambda: bench_dspark(chat_ids, "bfloat16")
        if args.spec:
            runs["dspark_bf16_spec"] = lambda: bench_dspark(chat_ids, "bfloat16", spec=True)
    if args.spec:
        runs["dspark_fp32_spec"] = lambda: bench_dspark(chat_ids, spec=True)
    if kernels.has_q4_1_kernels():  # the GGUF's own Q4_1 blocks (--matmul-dtype q4_1)
        runs["dspark_q4_1"] = lambda: bench_dspark(chat_ids, "q4_1")
        if args.spec:
            runs["dspark_q4_1_spec"] = lambda: bench_dspark(chat_ids, "q4_1", spec=True)
    if not args.skip_hf:
        runs["hf_transformers_fp32"] = lambda: bench_hf(chat_ids)
    try:
        import llama_cpp  # noqa: F401
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gguf_f32 import cached_copy
        src = Path(resolve_model_path("default"))
        for label, path in (("llama_cpp_f32", cached_copy(src, "f32")), ("llama_cpp_f16", cached_copy(src, "f16")),
                            ("llama_cpp_q4_1", src)):
            runs[label] = lambda path=path: bench_llama_cpp(chat_ids, path)
        runs["llama_cpp_q4_1_repack"] = lambda: bench_llama_cpp_child(chat_ids, src)
    except ImportError:
        print("llama-cpp-python not installed: skipping llama.cpp (PEERS=1 bash scripts/setup.sh)")
    # repeats rotate which engine goes first: this VM's speed drifts within a run (order bias)
    results: dict[str, list[float]] = {label: [] for label in runs}
    labels = list(runs)
    for r in range(args.repeats):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            results[label] += runs[label]()
    bw = memory_bandwidth_gbs()
    med = {k: statistics.median(v) for k, v in results.items() if v}
    summary = {
        "bench": "decode_batch1", "max_new_tokens": MAX_NEW,
        "command": "python benchmarks/bench_decode.py " + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
            for k, v in vars(args).items() if v not in (None, False)), "num_prompts": len(chat_ids),
        "threads": torch.get_num_threads(), "machine": platform.platform(), "date": time.strftime("%Y-%m-%d"),
        "decode_tok_s_median": {k: round(v, 1) for k, v in med.items()},
        "memory_bandwidth_gbs": round(bw, 1), "weight_bytes_fp32": weight_bytes,
        "weight_streaming_limit_tok_s": round(bw * 1e9 / weight_bytes, 1),
        "dspark_fraction_of_streaming_limit": round(med["dspark_fp32"] / (bw * 1e9 / weight_bytes), 3),
    }
    if "hf_transformers_fp32" in med:
        summary["dspark_vs_hf"] = round(med["dspark_fp32"] / med["hf_transformers_fp32"], 2)
    if "llama_cpp_f32" in med:
        summary["dspark_vs_llama_cpp_f32"] = round(med["dspark_fp32"] / med["llama_cpp_f32"], 2)
    for name in ("dspark_bf16", "dspark_bf16_spec", "dspark_fp32_spec", "dspark_q4_1", "dspark_q4_1_spec"):
        for base in ("dspark_fp32", "dspark_q4_1", "llama_cpp_q4_1", "llama_cpp_q4_1_repack"):
            if name == base:
                continue
            if name in med and base in med:
                summary[f"{name}_vs_{base}"] = round(med[name] / med[base], 2)
    for k, v in med.items():
        print(f"{k:24s} {v:8.1f} tok/s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": summary, "per_prompt": results}, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
