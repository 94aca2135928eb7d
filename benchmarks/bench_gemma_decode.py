"""Batch-1 greedy decode on gemma-3-270m (Q4_K_M GGUF, dequantized), side by side in one run: dspark
plain and with each drafter that serves this base model (n-gram prompt lookup; a layer-truncated
draft model of the target; the draft model with prompt lookup first), plus llama.cpp on the same GGUF
when llama-cpp-python is installed. Prompts: gsm8k questions as plain text (a base model continues
them), NEW tokens each, EOS ignored.

Reports decode tok/s (first token excluded), medians over prompts, and ratios to dspark plain. The last
stdout line is one JSON object; `--out` writes it too.

    python benchmarks/bench_gemma_decode.py --num-prompts 3 --out benchmarks/results/gemma_decode_batch1.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

NAME = "gemma-3-270m"
SPECS = {  # label -> speculative_config (None: plain)
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "draft_model_6": {"method": "draft_model", "draft_num_layers": 6, "num_speculative_tokens": 3},
    "draft_model_6_ngram_first": {"method": "draft_model", "draft_num_layers": 6, "num_speculative_tokens": 3,
                                  "ngram_first": True},
}


def bench_dspark(prompt_ids: list[list[int]], spec: dict | None, matmul_dtype: str, new: int) -> dict:
    from dspark import LLM, SamplingParams
    llm = LLM(NAME, max_num_seqs=1, matmul_dtype=matmul_dtype, speculative_config=spec)
    llm.generate([prompt_ids[0]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    rates, tokens = [], []
    for ids in prompt_ids:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))[0]
        rates.append((len(out.token_ids) - 1) / (out.e2e_s - out.ttft_s))
        tokens.append(list(out.token_ids))
    m = llm.engine.metrics
    tau = 1 + m.num_accepted_tokens / m.num_drafts if m.num_drafts else None
    return {"tok_s": rates, "median_tok_s": statistics.median(rates), "tokens": tokens, "tau": tau}


def bench_llama_cpp(prompt_ids: list[list[int]], new: int) -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    from dspark.models.loader import resolve_model_path
    llm = llama_cpp.Llama(model_path=str(resolve_model_path(NAME)), n_ctx=2048,
                          n_threads=torch.get_num_threads(), verbose=False)
    rates = []
    for ids in prompt_ids:
        llm.reset()
        n, t_first = 0, None
        for _ in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            n += 1
            t_first = t_first or time.perf_counter()
            if n >= new:
                break
        rates.append((n - 1) / (time.perf_counter() - t_first))
    return {"tok_s": rates, "median_tok_s": statistics.median(rates)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--matmul-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma list of labels of SPECS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dspark.bench.datasets import load_prompts
    from dspark.models.loader import load_model
    _, _, tok = load_model(NAME, matmul_dtype="float32")
    prompt_ids = [tok.encode(p.prompt) for p in load_prompts("gsm8k", num_prompts=args.num_prompts, seed=0)]
    labels = args.only.split(",") if args.only else list(SPECS)
    runs = {label: bench_dspark(prompt_ids, SPECS[label], args.matmul_dtype, args.new) for label in labels}
    peer = bench_llama_cpp(prompt_ids, args.new)
    if peer is not None:
        runs["llama_cpp"] = peer
    base = runs[labels[0]]["median_tok_s"]
    result = {
        "benchmark": "gemma_decode_batch1", "model": NAME, "new_tokens": args.new,
        "matmul_dtype": args.matmul_dtype, "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
        "command": "python benchmarks/bench_gemma_decode.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "llama_cpp": "installed" if peer is not None else "llama-cpp-python not installed: no peer row",
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in runs.items()},
        "vs_first": {k: v["median_tok_s"] / base for k, v in runs.items()},
        "greedy_equal_to_first": {k: v.get("tokens") == runs[labels[0]]["tokens"] for k, v in runs.items()
                                  if "tokens" in v},
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
