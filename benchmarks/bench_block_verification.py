"""Block verification against token-by-token rejection sampling: tokens per verification step of the default
model (SmolLM2-135M-Instruct) with the shipped DSpark drafter sampling its drafts (`draft_sample_method
"probabilistic"`, γ = 7, fixed length, no prompt lookup), at T = 0.7 and 1.0, on eval/ prompts (MT-Bench, GSM8K,
HumanEval) and on held-out train/ prompts (the rows `prepare-data --holdout 0.05` keeps out of training). Both
methods (two engines on the same weights and drafter) run the same prompts and seeds in one process, alternating; their outputs differ (a sampled output follows
its own path), their laws do not, so the figure is the mean over many requests.

    python benchmarks/bench_block_verification.py --per-set 8 --max-tokens 96 \
        --out benchmarks/results/block_verification.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("standard", "block")


def prompt_sets(per_set: int, seed: int) -> dict[str, list[str]]:
    from dspark.bench.datasets import load_prompts
    from dspark.train.data import is_holdout
    from dspark.train.prepare_data import prompt_rows

    sets = {name: [p.prompt for p in load_prompts(name, per_set, seed)] for name in ("mt-bench", "gsm8k", "humaneval")}
    train = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "train"
    held = [row for key, row in prompt_rows(str(train)) if is_holdout(key, 0.05)]
    by_source: dict[str, list[str]] = {}
    for row in held:
        by_source.setdefault(row.get("source", ""), []).append(row["turns"][0])
    mixed = [t for group in zip(*by_source.values()) for t in group]  # round robin over the sources
    sets["held-out"] = mixed[:per_set]
    return sets


def run(llm, prompts: list[list[int]], temperature: float, max_tokens: int) -> dict:
    from dspark.sampling import SamplingParams

    engine = llm.engine
    before = (engine.metrics.num_drafts, engine.metrics.num_accepted_tokens, engine.metrics.num_draft_tokens)
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1000 + i)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    steps = engine.metrics.num_drafts - before[0]
    accepted = engine.metrics.num_accepted_tokens - before[1]
    return {"verify_steps": steps, "accepted": accepted, "draft_tokens": engine.metrics.num_draft_tokens - before[2],
            "tokens_per_step": (steps + accepted) / steps if steps else None,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-set", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--rounds", type=int, default=2, help="each method runs every prompt set this many times")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/block_verification.json")
    args = p.parse_args(argv)

    import torch
    from dspark.config import SpecConfig
    from dspark.drafters.shipped import DEFAULT_NUM_SPECULATIVE_TOKENS, drafter_dir
    from dspark.config import DEFAULT_MODEL
    from dspark.llm import LLM

    llms = {method: LLM(speculative_config=SpecConfig(
        method="dspark", model=str(drafter_dir(DEFAULT_MODEL, "dspark")),
        num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS, draft_sample_method="probabilistic",
        rejection_sample_method=method), max_num_seqs=args.max_num_seqs) for method in METHODS}
    tok = llms["standard"].get_tokenizer()
    sets = {name: [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
                   for t in texts] for name, texts in prompt_sets(args.per_set, args.seed).items()}
    rows = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for r in range(args.rounds):
            for name, prompts in sets.items():
                order = METHODS if r % 2 == 0 else METHODS[::-1]
                for method in order:
                    res = run(llms[method], prompts, temperature, args.max_tokens)
                    rows.append({"temperature": temperature, "round": r, "set": name, "method": method, **res})
                    print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for temperature in sorted({row["temperature"] for row in rows}):
        for name in [*sets, "all"]:
            mine = [row for row in rows if row["temperature"] == temperature and name in (row["set"], "all")]
            tps = {}
            for method in METHODS:
                m = [row for row in mine if row["method"] == method]
                steps = sum(row["verify_steps"] for row in m)
                tps[method] = (steps + sum(row["accepted"] for row in m)) / steps if steps else None
            summary[f"T={temperature}/{name}"] = {**{f"{k}_tokens_per_step": v for k, v in tps.items()},
                                                  "ratio": tps["block"] / tps["standard"] if tps["standard"] else None}
    result = {"command": " ".join(["benchmarks/bench_block_verification.py", *(argv or sys.argv[1:])]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.platform()}, {platform.machine()}, torch {torch.__version__}",
              "spec": {"method": "dspark", "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS,
                       "draft_sample_method": "probabilistic", "length_policy": "fixed"},
              "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
