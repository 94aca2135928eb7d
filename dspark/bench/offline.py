"""`dspark bench offline`: the offline `LLM` API without HTTP: batch throughput and batch-1 latency,
optionally with peers (HF transformers, llama.cpp) measured side by side at batch 1.

    dspark bench offline --num-prompts 8 --max-tokens 128 --batch-sizes 1,8,32
    dspark bench offline --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
        --peers --out benchmarks/results/offline_smollm2.json

Prompts: chat prompts of `--dataset` (see `dspark.bench.datasets`), rendered with the model's
chat template into token ids once, so every engine reads the same ids. Output length is fixed at
`--max-tokens` (EOS ignored) unless `--natural-stop`; peers then still generate exactly as many
tokens as dspark did for that prompt.
- Throughput at batch size B: prompts in groups of B, each group submitted at once; total output
  tokens / total wall time (`batch_output_tok_s`). max(num_prompts, B) prompts (cycled).
- Batch-1 latency: each prompt alone; TTFT = first token, TPOT = (e2e − TTFT) / (tokens − 1);
  medians over prompts (`decode_tok_s` = 1000 / TPOT ms). τ from the engine's spec stats.
- `--peers`: HF `generate` (greedy, plain and prompt lookup with `--prompt-lookup-num-tokens`) and
  llama-cpp-python (plain, and `LlamaPromptLookupDecoding`), same prompts and output lengths, batch
  1. llama.cpp needs a GGUF: the model itself, or `--llama-cpp-gguf` (e.g. an F32 copy from
  benchmarks/gguf_f32.py). A peer whose package is absent is skipped with a message.
The last stdout line is the JSON result (also written to `--out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from dspark.bench.peers import hf_peer, llama_cpp_peer
from dspark.bench.report import json_safe, latency_summary, run_info


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def register(subparsers) -> argparse.ArgumentParser:
    from dspark.cli import add_engine_args

    p = subparsers.add_parser("offline", help="offline LLM API throughput and latency (+ peers)",
                              description=__doc__.split("\n\n")[0])
    add_engine_args(p, positional_model=False)
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32])
    p.add_argument("--natural-stop", action="store_true", help="stop at EOS (default: ignore it)")
    p.add_argument("--peers", action="store_true", help="also HF transformers and llama.cpp")
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=4)
    p.add_argument("--llama-cpp-gguf", default=None, help="GGUF for llama.cpp (default: MODEL)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.set_defaults(func=run_cli)
    return p


def chat_prompt_ids(tokenizer, dataset: str, num_prompts: int, seed: int) -> list[list[int]]:
    from dspark.bench.datasets import load_prompts

    return [tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}])
            for p in load_prompts(dataset, num_prompts, seed)]


def batch_throughput(llm, prompt_ids: list[list[int]], params, batch_size: int) -> dict:
    """Prompts in groups of `batch_size`, each submitted at once; throughput over all groups."""
    num = max(len(prompt_ids), batch_size)
    num += -num % batch_size
    cycled = [prompt_ids[i % len(prompt_ids)] for i in range(num)]
    num_tokens, wall_s = 0, 0.0
    for start in range(0, num, batch_size):
        t0 = time.perf_counter()
        outs = llm.generate(cycled[start:start + batch_size], params)
        wall_s += time.perf_counter() - t0
        num_tokens += sum(len(o.token_ids) for o in outs)
    return {"batch_size": batch_size, "num_prompts": num, "total_output_tokens": num_tokens,
            "wall_s": wall_s, "batch_output_tok_s": num_tokens / wall_s if wall_s else None}


def batch1_latency(llm, prompt_ids: list[list[int]], params) -> tuple[dict, list[int]]:
    """Each prompt alone → (latency summary with τ, output length of each prompt)."""
    ttft, tpot, lengths = [], [], []
    drafts = accepted = 0
    for ids in prompt_ids:
        out = llm.generate([ids], params)[0]
        n = len(out.token_ids)
        lengths.append(n)
        ttft.append(out.ttft_s)
        if n > 1:
            tpot.append((out.e2e_s - out.ttft_s) / (n - 1))
        drafts += out.spec.num_drafts
        accepted += out.spec.num_accepted_tokens
    summary = latency_summary(ttft, tpot)
    summary["tau"] = 1.0 + accepted / drafts if drafts else None
    summary["total_output_tokens"] = sum(lengths)
    return summary, lengths


def run_cli(args: argparse.Namespace) -> int:
    from dspark import LLM, SamplingParams
    from dspark.cli import engine_config_from_args

    config = engine_config_from_args(args)
    max_batch = max(args.batch_sizes)
    if config.scheduler.max_num_seqs < max_batch:
        config = dataclasses.replace(config, scheduler=dataclasses.replace(
            config.scheduler, max_num_seqs=max_batch))
    llm = LLM(config=config)
    prompt_ids = chat_prompt_ids(llm.tokenizer, args.dataset, args.num_prompts, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            ignore_eos=not args.natural_stop)
    llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    result: dict = {"bench": "offline", **run_info(), "model": args.model,
                    "speculative_config": args.speculative_config, "dataset": args.dataset,
                    "num_prompts": len(prompt_ids), "max_tokens": args.max_tokens,
                    "ignore_eos": not args.natural_stop}
    result["throughput"] = [batch_throughput(llm, prompt_ids, params, b) for b in args.batch_sizes]
    dspark_b1, lengths = batch1_latency(llm, prompt_ids, params)
    result["batch1"] = {"dspark": dspark_b1}
    skipped: dict[str, str] = {}
    if args.peers:
        del llm  # free the engine's KV pool before loading peers
        peer_args = dict(model=args.model, prompt_ids=prompt_ids, lengths=lengths,
                         prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
                         num_threads=args.num_threads)
        for peer in (hf_peer, llama_cpp_peer):
            measured, why = peer(**peer_args, gguf=args.llama_cpp_gguf)
            result["batch1"].update(measured)
            skipped.update(why)
        for name, why in skipped.items():
            print(f"[offline] skipping {name}: {why}", file=sys.stderr)
    result["skipped_peers"] = skipped
    _print_tables(result)
    line = json.dumps(json_safe(result), allow_nan=False)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
    print(line, flush=True)
    return 0


def _print_tables(result: dict) -> None:
    print(f"{'batch':>6} {'prompts':>8} {'out tok':>8} {'tok/s':>9}")
    for row in result["throughput"]:
        print(f"{row['batch_size']:>6} {row['num_prompts']:>8} {row['total_output_tokens']:>8} "
              f"{row['batch_output_tok_s'] or 0:>9.1f}")
    print(f"{'batch 1':<34} {'TTFT ms':>8} {'TPOT ms':>8} {'tok/s':>8} {'tau':>5}")
    for name, row in result["batch1"].items():
        tau = row.get("tau")
        print(f"{name:<34} {row['median_ttft_ms'] or 0:>8.1f} {row['median_tpot_ms'] or 0:>8.2f} "
              f"{row['decode_tok_s'] or 0:>8.1f} {tau if tau is None else round(tau, 2)!s:>5}")
