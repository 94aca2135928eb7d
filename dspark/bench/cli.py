"""`dspark bench serve`: benchmark any OpenAI-compatible streaming server.

Run:
    dspark bench serve --base-url http://127.0.0.1:8000 --dataset-name gsm8k --num-prompts 200 \
        --max-concurrency 16 --max-tokens 256 --result-file results/serve_c16.json
    dspark bench serve --backend openai --endpoint /v1/completions --dataset-name random \
        --random-input-len 512 --random-output-len 128 --num-prompts 100 --save-result --result-dir out
    python -m dspark.bench.cli serve ...        # the same, without the top-level CLI

Prints a summary table and, as the last stdout line, one JSON object of aggregate metrics under
`vllm bench serve`'s keys; `--result-file` / `--save-result` get everything including per-request
records. Flags are generated from `BenchConfig`'s fields (vLLM's spellings where vLLM has the option).

From Python (sweeps): `run_bench(BenchConfig(max_concurrency=8, label="dspark")) -> dict`.
The top-level CLI mounts this with
    bench = sub.add_parser("bench")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    register(bsub)          # then: args = parser.parse_args(); sys.exit(args.func(args))
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from dataclasses import asdict
from pathlib import Path

from dspark.bench.client import BenchConfig, run_load
from dspark.bench.datasets import load_prompts
from dspark.bench.metrics import compute_metrics, parse_goodput, spec_decode_stats
from dspark.bench.report import print_report, write_result_file

_RESULT_CONFIG_KEYS = ("label", "endpoint", "dataset", "num_prompts", "max_tokens", "ignore_eos",
                       "max_concurrency", "request_rate", "burstiness", "temperature", "seed", "prompt_offset")
OUTPUT_LEN_FIELDS = {"random": "random_output_len", "sharegpt": "sharegpt_output_len", "custom": "custom_output_len"}


async def _fit_random(cfg: BenchConfig, rows):
    """Random prompts cut to their token counts by the server's /tokenize and /detokenize; kept as words
    (about one token each) where the server has neither."""
    import httpx

    from dspark.bench.client import _headers, server_root
    from dspark.bench.datasets import fit_token_lengths
    root, headers = server_root(cfg.base_url), _headers(cfg.api_key)
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as client:
        async def tokenize(text):
            r = await client.post(root + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                                  headers=headers)
            r.raise_for_status()
            return r.json()["tokens"]

        async def detokenize(ids):
            r = await client.post(root + "/detokenize", json={"tokens": ids}, headers=headers)
            r.raise_for_status()
            return r.json()["prompt"]
        try:
            return await fit_token_lengths(rows, tokenize, detokenize)
        except httpx.HTTPError as e:
            print(f"[bench] the server cannot tokenize ({e}); random prompts keep one word per token wanted",
                  file=sys.stderr)
            return rows


async def arun_bench(cfg: BenchConfig) -> dict:
    """`run_bench` for callers already inside an event loop."""
    out_len = getattr(cfg, OUTPUT_LEN_FIELDS.get(cfg.dataset, ""), None)
    if out_len is not None:
        cfg = dataclasses.replace(cfg, max_tokens=out_len)
    start, end = cfg.prompt_offset, cfg.prompt_offset + cfg.num_prompts
    rows = load_prompts(cfg.dataset, end + cfg.num_warmup, cfg.seed, cfg.random_input_len,
                        dataset_path=cfg.dataset_path, random_range_ratio=cfg.random_range_ratio)
    if cfg.dataset == "random":
        rows = await _fit_random(cfg, rows)
    run = await run_load(cfg, rows[start:end], warmup_prompts=rows[end:])
    import datetime
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")  # vLLM's format
    result: dict = {"date": date, "backend": cfg.backend or f"openai-{cfg.endpoint}",
                    "model_id": run.model, "tokenizer_id": run.model, "model": run.model}
    result |= {k: getattr(cfg, k) for k in _RESULT_CONFIG_KEYS}
    metrics = compute_metrics(run.records, run.wall_time_s, percentiles=cfg.percentiles,
                              goodput=parse_goodput(cfg.goodput))
    dropped = {"ttft", "tpot", "itl", "e2el"} - set(cfg.metrics)
    result |= {k: v for k, v in metrics.items() if not any(k.endswith(f"_{m}_ms") for m in dropped)}
    spec = spec_decode_stats(run.metrics_before_text, run.metrics_after_text)
    if spec is not None:
        result |= spec
    result["config"] = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    result["requests"] = [asdict(r) for r in run.records]
    for path in result_paths(cfg, result):
        write_result_file(path, result)
    return result


def result_paths(cfg: BenchConfig, result: dict) -> list[Path]:
    """--result-file, and with --save-result vLLM's RESULT_DIR / RESULT_FILENAME (default
    `{label or backend}-{rate}qps-concurrency{c}-{model}-{date}.json`)."""
    paths = [Path(cfg.result_file)] if cfg.result_file else []
    if cfg.save_result:
        name = cfg.result_filename or (
            f"{cfg.label or result['backend']}-{cfg.request_rate}qps-concurrency{cfg.max_concurrency}-"
            f"{str(result['model_id']).rstrip('/').split('/')[-1]}-"
            f"{result['date']}.json")
        paths.append(Path(cfg.result_dir or ".") / name)
    return paths


def run_bench(cfg: BenchConfig) -> dict:
    """Run one serving benchmark and return the result dict: vLLM's keys (`duration`, `completed`,
    `output_throughput`, `mean_tpot_ms`, `spec_decode_acceptance_length`, ...) plus dspark's (`clock_check`,
    `per_user_output_tok_s`, ...), `config`, and `requests` (per-request records). Writes the result files
    cfg names."""
    return asyncio.run(arun_bench(cfg))


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to a `bench` subparser group; it sets `func` to the handler."""
    from dspark.engine_args import add_arguments
    p = subparsers.add_parser("serve", help="benchmark an OpenAI-compatible streaming server",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p, BenchConfig)
    p.add_argument("--tokenizer", default=None,
                   help="accepted for vLLM command lines; token counts come from the server (usage, /tokenize)")
    p.set_defaults(func=_cmd_serve)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from dspark.engine_args import config_from_args as from_args
    try:
        return from_args(args, BenchConfig)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def _cmd_serve(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    result = run_bench(cfg)
    print_report(result)
    for path in result_paths(cfg, result):
        print(f"[bench] full results written to {path}", file=sys.stderr)
    return 0 if result["completed"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m dspark.bench.cli ...` = `dspark bench ...` (serve, sweep, offline)."""
    from dspark.cli import main as dspark_main
    return dspark_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
