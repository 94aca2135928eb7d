"""`dspark bench serve`: benchmark any OpenAI-compatible streaming server.

Run:
    dspark bench serve --base-url http://127.0.0.1:8000 --dataset gsm8k --num-prompts 200 \
        --max-concurrency 16 --max-tokens 256 --result-file results/serve_c16.json
    python -m dspark.bench.cli serve ...        # the same, without the top-level CLI

Prints a summary table and, as the last stdout line, one JSON object of aggregate metrics; the
`--result-file` gets everything including per-request records. Flags are the `BenchConfig` field
names in kebab case, with the defaults of `BenchConfig`.

From Python (sweeps): `run_bench(BenchConfig(max_concurrency=8, label="dspark")) -> dict`.
The top-level CLI mounts this with
    bench = sub.add_parser("bench")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    register(bsub)          # then: args = parser.parse_args(); sys.exit(args.func(args))
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict, fields

from dspark.bench.client import BenchConfig, run_load
from dspark.bench.datasets import load_prompts
from dspark.bench.metrics import compute_metrics, spec_decode_stats
from dspark.bench.report import print_report, write_result_file

_RESULT_CONFIG_KEYS = ("label", "endpoint", "dataset", "num_prompts", "max_tokens", "ignore_eos",
                       "max_concurrency", "request_rate", "burstiness", "temperature", "seed", "prompt_offset")


async def arun_bench(cfg: BenchConfig) -> dict:
    """`run_bench` for callers already inside an event loop."""
    start, end = cfg.prompt_offset, cfg.prompt_offset + cfg.num_prompts
    rows = load_prompts(cfg.dataset, end + cfg.num_warmup, cfg.seed, cfg.random_input_len)
    run = await run_load(cfg, rows[start:end], warmup_prompts=rows[end:])
    result: dict = {"model": run.model} | {k: getattr(cfg, k) for k in _RESULT_CONFIG_KEYS}
    result |= compute_metrics(run.records, run.wall_time_s)
    spec = spec_decode_stats(run.metrics_before_text, run.metrics_after_text)
    if spec is not None:
        result["spec_decode"] = spec
    result["config"] = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    result["requests"] = [asdict(r) for r in run.records]
    if cfg.result_file:
        write_result_file(cfg.result_file, result)
    return result


def run_bench(cfg: BenchConfig) -> dict:
    """Run one serving benchmark and return the result dict: aggregate metrics (flat keys such as
    `output_throughput_tok_s`, `mean_tpot_ms`), `spec_decode` (if the server exports the counters),
    `clock_check`, `config`, and `requests` (per-request records).
    Writes `cfg.result_file` if set."""
    return asyncio.run(arun_bench(cfg))


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "0", "inf", "unbounded") else int(text)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to a `bench` subparser group; it sets `func` to the handler."""
    d = {f.name: f.default for f in fields(BenchConfig)}
    p = subparsers.add_parser("serve", help="benchmark an OpenAI-compatible streaming server",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=d["base_url"])
    p.add_argument("--model", default=d["model"], help="default: first id of /v1/models")
    p.add_argument("--endpoint", choices=("chat", "completions"), default=d["endpoint"])
    p.add_argument("--dataset", default=d["dataset"],
                   help="gsm8k|math500|humaneval|mbpp|livecodebench|mt-bench|math|code|chat|all|"
                        "random|PATH.jsonl")
    p.add_argument("--num-prompts", type=int, default=d["num_prompts"])
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"])
    eos = p.add_mutually_exclusive_group()
    eos.add_argument("--ignore-eos", dest="ignore_eos", action="store_true",
                     default=d["ignore_eos"], help="fixed output length: always max-tokens")
    eos.add_argument("--natural-stop", dest="ignore_eos", action="store_false",
                     help="stop at EOS (default)")
    p.add_argument("--max-concurrency", type=_optional_int, default=d["max_concurrency"],
                   help="max requests in flight (default: unbounded)")
    p.add_argument("--request-rate", type=float, default=d["request_rate"],
                   help="requests/s, gamma arrivals (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=d["burstiness"],
                   help="gamma shape of inter-arrival times; 1 = Poisson")
    p.add_argument("--num-warmup", type=int, default=d["num_warmup"])
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--prompt-offset", type=int, default=d["prompt_offset"],
                   help="skip this many prompts of the seed's order (the warm-up takes the ones after the "
                        "measured prompts)")
    p.add_argument("--result-file", default=d["result_file"])
    p.add_argument("--api-key", default=d["api_key"])
    p.add_argument("--temperature", type=float, default=d["temperature"])
    p.add_argument("--random-input-len", type=int, default=d["random_input_len"],
                   help="words per prompt for --dataset random")
    p.add_argument("--request-timeout-s", type=float, default=d["request_timeout_s"])
    p.add_argument("--no-progress", dest="progress", action="store_false", default=d["progress"])
    p.add_argument("--label", default=d["label"], help="method name stored in the results")
    p.set_defaults(func=_cmd_serve)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(**{f.name: getattr(args, f.name) for f in fields(BenchConfig)})


def _cmd_serve(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    result = run_bench(cfg)
    print_report(result)
    if cfg.result_file:
        print(f"[bench] full results written to {cfg.result_file}", file=sys.stderr)
    return 0 if result["num_completed"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m dspark.bench.cli ...` = `dspark bench ...` (serve, sweep, offline)."""
    from dspark.cli import main as dspark_main
    return dspark_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
