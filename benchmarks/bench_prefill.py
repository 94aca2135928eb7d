"""Prompt processing (time to first token) of one request at a time, matmul dtypes side by side in one
process: each round runs every prompt length with every dtype once (medians over rounds), so a slow
phase of the machine hits all alike. No speculation; the prompts are eval/ text cut to each length.

    python benchmarks/bench_prefill.py --matmul-dtypes float32,q4_1 --lengths 128,512 --out benchmarks/results/prefill.json
"""

from __future__ import annotations

import argparse
import statistics

from dspark.bench.report import run_info, write_result_file


def main(argv: list[str] | None = None) -> dict:
    from dspark.bench.datasets import load_prompts
    from dspark.engine.build import resolve_matmul_dtype
    from dspark.llm import LLM
    from dspark.models.loader import DEFAULT_MODEL
    from dspark.sampling import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--matmul-dtypes", default="float32,auto")
    p.add_argument("--lengths", default="128,512", help="prompt lengths in tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtypes = list(dict.fromkeys(resolve_matmul_dtype(d, model=DEFAULT_MODEL) for d in args.matmul_dtypes.split(",")))
    lengths = [int(n) for n in args.lengths.split(",")]
    engines = {d: LLM(speculative_config=None, max_num_seqs=1, matmul_dtype=d) for d in dtypes}
    tok = next(iter(engines.values())).tokenizer
    text = " ".join(r.prompt for r in load_prompts("all", num_prompts=40, seed=0))
    ids = tok.encode(text)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times: dict[tuple[str, int], list[float]] = {(d, n): [] for d in dtypes for n in lengths}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n in lengths:
            prompt = ids[r * 7:r * 7 + n]  # another cut each round: no prefix-cache hit
            for d, llm in engines.items():
                out = llm.generate([prompt], params)[0]
                if r:
                    times[(d, n)].append(out.ttft_s * 1e3)
    rows = [{"matmul_dtype": d, "prompt_tokens": n, "ttft_ms": statistics.median(v), "ttft_ms_all": v}
            for (d, n), v in times.items()]
    for row in rows:
        print(f"{row['matmul_dtype']:>8s} {row['prompt_tokens']:5d} tokens: {row['ttft_ms']:8.1f} ms")
    summary = {f"{row['matmul_dtype']}_{row['prompt_tokens']}_ttft_ms": round(row["ttft_ms"], 1) for row in rows}
    result = {"bench": "prefill_ttft", "summary": summary, "rows": rows, **run_info(argv)}
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
