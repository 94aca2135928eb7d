"""The DSpark drafter's acceptance under its product dtypes, side by side: the same greedy chats, the target
verifying a fixed γ = 7 drafts every step (no lookup, no scheduler), one engine per `draft_matmul_dtype`;
reports drafted and accepted tokens, the acceptance rate and τ (tokens per verify step), and each dtype
÷ the first. The target's output is the same for all (lossless); only what the drafter proposes moves.

    python benchmarks/bench_draft_accept_dtype.py --dtypes auto,q4_1 --num-prompts 10 \
        --out benchmarks/results/draft_accept_dtype.json

Prompts: the first `--num-prompts` of eval/ gsm8k and of humaneval (seed 1), `--max-tokens` new tokens
each (EOS ignored).
"""

from __future__ import annotations

import argparse

from dspark.bench.report import run_info, write_result_file

DRAFTER = "dspark/assets/drafters/dspark-smollm2-135m"


def main(argv: list[str] | None = None) -> dict:
    from dspark.bench.datasets import load_prompts
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", default="auto,q4_1")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    prompts = [r.prompt for ds in ("gsm8k", "humaneval") for r in load_prompts(ds, num_prompts=args.num_prompts, seed=1)]
    chats = [[{"role": "user", "content": text}] for text in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows, outputs = {}, {}
    for dtype in args.dtypes.split(","):
        llm = LLM(speculative_config={"method": "dspark", "model": DRAFTER, "num_speculative_tokens": 7,
                                      "length_policy": "fixed", "draft_matmul_dtype": dtype})
        outputs[dtype] = [o.token_ids for o in llm.chat(chats, params)]
        m = llm.engine.metrics
        rounds = m.num_draft_tokens / 7
        rows[dtype] = {"draft_tokens": m.num_draft_tokens, "accepted_tokens": m.num_accepted_tokens,
                       "acceptance_rate": round(m.num_accepted_tokens / m.num_draft_tokens, 4),
                       "tau": round(1 + m.num_accepted_tokens / rounds, 3)}
        print(dtype, rows[dtype], flush=True)
    first = next(iter(rows))
    for dtype, row in rows.items():
        row["tau_over_" + first] = round(row["tau"] / rows[first]["tau"], 3)
    same = all(outputs[d] == outputs[first] for d in outputs)
    result = {"bench": "draft_accept_dtype", "summary": rows, "outputs_identical": same, "config": vars(args),
              **run_info()}
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
