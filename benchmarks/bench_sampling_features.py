"""Cost of the sampling features with speculation on: logprobs (top 5), penalties, a json_schema grammar.

For batch 1 and c = 8 concurrent requests, output tok/s of the default model with its default speculative
config and with plain decoding, for each feature beside the same run without it. Runs are interleaved
(every variant once per repeat, in turn) and the figures are medians over repeats of per-repeat ratios,
since the machine is shared and noisy.

    OMP_NUM_THREADS=1 python benchmarks/bench_sampling_features.py --repeats 3 --max-tokens 32 --threads 1 \
        --out benchmarks/results/sampling_features_xeon_amx.json

Targets: logprobs and penalties cost <= 5% (feature ÷ base >= 0.95), the grammar <= 15%, and speculation
keeps >= 90% of its speedup with each on ((spec ÷ plain with the feature - 1) >= 0.9 (spec ÷ plain without - 1)).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

from dspark import LLM, SamplingParams
from dspark.config import DEFAULT_MODEL
from dspark.drafters.shipped import default_spec_config
from dspark.engine.build import resolve_matmul_dtype

QUESTIONS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether?",
             "Write a short story about a robot who learns to paint.",
             "Explain how a bicycle stays upright.",
             "List three facts about the moon and explain each.",
             "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
             "How much did she earn?",
             "Describe your ideal weekend in detail.",
             "What are the benefits of learning a second language?",
             "Write a Python function that reverses a string, and explain it."]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    "city": {"type": "string", "maxLength": 40}}, "required": ["name", "age", "hobbies", "city"],
    "additionalProperties": False}


def variants(max_tokens: int) -> dict[str, SamplingParams]:
    base = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return {"base": base,
            "logprobs5": dataclasses.replace(base, logprobs=5),
            "penalties": dataclasses.replace(base, presence_penalty=0.3, frequency_penalty=0.3,
                                             repetition_penalty=1.1),
            "json_schema": dataclasses.replace(base, structured_outputs={"json": SCHEMA})}


def conversations(n: int, json_mode: bool) -> list[list[dict]]:
    suffix = " Answer as JSON with name, age, hobbies and city of a person it makes you think of." if json_mode else ""
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + suffix}] for i in range(n)]


def one_run(llm: LLM, params: SamplingParams, num_prompts: int, json_mode: bool) -> dict:
    m = llm.engine.metrics
    drafts0, accepted0 = m.num_draft_tokens, m.num_accepted_tokens
    start = time.perf_counter()
    outs = llm.chat(conversations(num_prompts, json_mode), params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    drafts, accepted = m.num_draft_tokens - drafts0, m.num_accepted_tokens - accepted0
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "acceptance": accepted / drafts if drafts else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--loads", default="1,8", help="concurrent requests per run")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=None, help="engine threads (1 on a crowded machine)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = default_spec_config(DEFAULT_MODEL, matmul_dtype=resolve_matmul_dtype("auto", model=DEFAULT_MODEL))
    kw = dict(kv_cache_memory_gb=args.kv_cache_memory_gb,  # two engines live side by side
              num_threads=args.threads)
    engines = {"plain": LLM(DEFAULT_MODEL, **kw),
               "spec": LLM(DEFAULT_MODEL, speculative_config=dataclasses.asdict(spec), **kw)}
    loads = [int(x) for x in args.loads.split(",")]
    params = variants(args.max_tokens)
    for llm in engines.values():  # warm-up: kernels, shapes, the grammar library's tokenizer
        for name, p in params.items():
            one_run(llm, dataclasses.replace(p, max_tokens=8), 2, name == "json_schema")
    runs: dict[str, list[dict]] = {}
    for r in range(args.repeats):
        for load in loads:
            for name, p in params.items():
                for mode, llm in engines.items():
                    key = f"c{load}/{name}/{mode}"
                    runs.setdefault(key, []).append(one_run(llm, p, load, name == "json_schema"))
                    print(key, f"{runs[key][-1]['tok_s']:.1f} tok/s", flush=True)
    summary = {}
    for load in loads:
        for name in params:
            def tok(mode, variant=name):
                return [x["tok_s"] for x in runs[f"c{load}/{variant}/{mode}"]]
            feat_cost = statistics.median(a / b for a, b in zip(tok("spec"), tok("spec", "base")))
            spec_gain = statistics.median(a / b for a, b in zip(tok("spec"), tok("plain")))
            base_gain = statistics.median(a / b for a, b in zip(tok("spec", "base"), tok("plain", "base")))
            acc = [x["acceptance"] for x in runs[f"c{load}/{name}/spec"] if x["acceptance"] is not None]
            summary[f"c{load}/{name}"] = {
                "spec_tok_s": statistics.median(tok("spec")), "plain_tok_s": statistics.median(tok("plain")),
                "feature_over_base_spec": feat_cost, "spec_over_plain": spec_gain,
                "speedup_kept": (spec_gain - 1) / (base_gain - 1) if base_gain != 1 else None,
                "acceptance": statistics.median(acc) if acc else None}
    result = {"command": "python benchmarks/bench_sampling_features.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
              "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "model": DEFAULT_MODEL, "summary": summary, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
