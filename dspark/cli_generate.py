"""`dspark generate "prompt"`: one completion on the command line, with tokens/s and time to first
token.

    dspark generate "Write a haiku about the sea." --max-tokens 64
    dspark generate --raw "The capital of France is" --temperature 0
"""

from __future__ import annotations

import argparse
import sys
import time


def register(sub) -> None:
    from dspark.cli import add_engine_args
    p = sub.add_parser("generate", help="generate one completion and print speed")
    p.add_argument("prompt")
    add_engine_args(p, positional_model=False)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dspark.cli import engine_config_from_args
    from dspark.engine.build import build_engine
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    config = engine_config_from_args(args)
    engine, tokenizer = build_engine(config)
    llm = LLM(engine=engine, tokenizer=tokenizer)
    llm.generate([[1]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    if args.raw:
        out = llm.generate(args.prompt, params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    elapsed = time.perf_counter() - t0
    n = len(out.token_ids)
    print(out.text)
    decode_s = max(elapsed - out.ttft_s, 1e-9)
    print(f"\n[{n} tokens in {elapsed:.2f} s | {n / elapsed:.1f} tok/s overall | "
          f"{(n - 1) / decode_s:.1f} tok/s after the first | TTFT {out.ttft_s * 1000:.0f} ms"
          + (f" | acceptance length {out.spec.acceptance_length:.2f}" if out.spec.num_drafts else "")
          + f" | finish: {out.outputs[0].finish_reason}]", file=sys.stderr)
    return 0
