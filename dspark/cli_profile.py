"""`dspark profile`: measure the step-cost table SPS(B) that the prefix scheduler (length policies
"prefix" / "async") reads, on the current model, device and dtype, and save it as JSON.

    dspark profile SmolLM2-135M-Instruct --out cost_table.json
    dspark profile MODEL --speculative-config '{"method": "dspark", "model": "ckpt/dspark"}' \
        --token-counts 1,2,4,8,16,32,64,128 --draft-num-reqs 1,2,4,8,16,32,64 --out cost_table.json

Then serve with `{"length_policy": "prefix", "cost_table": "cost_table.json", ...}`.

How: the engine is built exactly as for serving (same runner, KV pool, taps). For each token count B
the profiler makes a synthetic verification batch — ceil(B / tokens_per_request) requests, each
with `--context-len` committed positions (default 256) and a verify window [last, d1 .. dℓ], B tokens
in all — and times `ModelRunner.prepare` + `forward` (the whole target step as the engine runs it,
tensor building included) with `cost_table.profile` (warm-up calls, then the median of `--repeats`).
The pool slots are allocated through the engine's `BlockManager`; K/V contents are whatever the pool
holds (timing does not depend on values). With a speculative config, the drafter's `propose` for R
requests at that context is timed too (drafter context extension is not included). The device is
synchronised after each call on CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from dspark.engine.step_profiler import DEFAULT_DRAFT_NUM_REQS, DEFAULT_TOKEN_COUNTS, profile_engine


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def register(sub) -> None:
    from dspark.cli import add_engine_args
    p = sub.add_parser("profile", help="measure the SPS(B) step-cost table for the prefix scheduler")
    add_engine_args(p, positional_model=True)
    p.add_argument("--out", default="cost_table.json")
    p.add_argument("--token-counts", type=_int_list, default=list(DEFAULT_TOKEN_COUNTS))
    p.add_argument("--draft-num-reqs", type=_int_list, default=list(DEFAULT_DRAFT_NUM_REQS))
    p.add_argument("--context-len", type=int, default=256, help="committed positions per request")
    p.add_argument("--tokens-per-request", type=int, default=None, help="verify window (default γ+1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from dspark.cli import engine_config_from_args
    from dspark.engine.build import build_engine

    config = engine_config_from_args(args)
    if config.spec is not None:  # the prefix policies need the very table being measured
        config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, length_policy="fixed",
                                                                      cost_table=None))
    engine, _ = build_engine(config)
    draft_num_reqs = [n for n in args.draft_num_reqs if n <= config.scheduler.max_num_seqs]
    try:
        table = profile_engine(engine, token_counts=args.token_counts, draft_num_reqs=draft_num_reqs,
                               context_len=args.context_len, tokens_per_request=args.tokens_per_request,
                               repeats=args.repeats, warmup=args.warmup)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"error: {e}")
    table.save(args.out)
    print(f"{'tokens':>7} {'steps/s':>9} {'ms/step':>8}")
    for n, sps in zip(table.num_tokens, table.steps_per_second):
        print(f"{n:>7} {sps:>9.1f} {1000 / sps:>8.2f}")
    for n, s in zip(table.draft_num_reqs, table.draft_seconds):
        print(f"draft  {n:>3} requests: {1000 * s:.2f} ms")
    print(f"wrote {args.out}")
    print(json.dumps({"out": args.out, **table.to_dict()}))
    return 0
