"""`--kv-cache-dtype fp8` against the default KV dtype on the default model: the tokens a fixed pool holds,
decode tok/s at batch 1 and 8 (the served default speculation, greedy, 128 tokens; the two engines
alternating within each round), and the drift: prompt logprobs against the full-precision KV and the share
of greedy outputs that stay identical.

    python benchmarks/bench_fp8_kv.py --rounds 3 --out benchmarks/results/fp8_kv.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv: list[str] | None = None) -> dict:
    from dspark.bench.datasets import load_prompts
    from dspark.bench.report import run_info, write_result_file
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--pool-bytes", type=int, default=64 * 2**20, help="the fixed pool of the capacity figure")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--out", default="benchmarks/results/fp8_kv.json")
    args = p.parse_args(argv)
    kinds = ("auto", "fp8")
    llms = {k: LLM(kv_cache_dtype=k, kv_cache_memory_bytes=args.pool_bytes, speculative_config="default")
            for k in kinds}
    capacity = {k: llm.engine.block_manager.num_free_blocks * llm.engine.config.cache.kv_block_size
                for k, llm in llms.items()}
    prompts = [[{"role": "user", "content": r.prompt}] for r in load_prompts(args.dataset, 16, 0)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = {k: llm.chat(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, prompt_logprobs=0),
                           use_tqdm=False) for k, llm in llms.items()}
    diffs = [abs(a.logprob - b.logprob) for x, y in zip(outputs["auto"], outputs["fp8"])
             for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])]
    same = sum(x.token_ids == y.token_ids for x, y in zip(outputs["auto"], outputs["fp8"]))
    speed: dict[str, dict[int, list[float]]] = {k: {1: [], 8: []} for k in kinds}
    for r in range(args.rounds):
        for k in (kinds if r % 2 == 0 else tuple(reversed(kinds))):
            for batch in (1, 8):
                chosen = prompts[:4] if batch == 1 else prompts[:batch]
                t = time.perf_counter()
                if batch == 1:
                    outs = [llms[k].chat([c], greedy, use_tqdm=False)[0] for c in chosen]
                else:
                    outs = llms[k].chat(chosen, greedy, use_tqdm=False)
                speed[k][batch].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
                print(f"round {r} {k} batch {batch}: {speed[k][batch][-1]:.1f} tok/s", flush=True)
    summary = {"pool_bytes": args.pool_bytes, "tokens_in_pool": capacity,
               "capacity_ratio": capacity["fp8"] / capacity["auto"],
               "prompt_logprob_abs_diff": {"max": max(diffs), "mean": statistics.fmean(diffs),
                                           "positions": len(diffs)},
               "identical_greedy_outputs": f"{same}/{len(prompts)}",
               **{f"batch{b}": {"auto_tok_s": statistics.median(speed["auto"][b]),
                                "fp8_tok_s": statistics.median(speed["fp8"][b]),
                                "fp8_over_auto": statistics.median(speed["fp8"][b]) / statistics.median(speed["auto"][b])}
                  for b in (1, 8)}}
    result = {**run_info(argv), "dataset": args.dataset, "max_tokens": args.max_tokens, "rounds": speed,
              "summary": summary}
    write_result_file(args.out, result)
    print(json.dumps(summary))
    return result


if __name__ == "__main__":
    main()
