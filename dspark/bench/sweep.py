"""`dspark bench sweep`: serve each method in turn and run the serving benchmark over a grid of
concurrencies and datasets, then write results.json, report.md and plots.

    dspark bench sweep --model SmolLM2-135M-Instruct \
        --methods none,ngram,dspark-k3,dspark-k7,dspark-prefix --drafter-dir dspark=ckpt/dspark \
        --concurrency 1,4,8,16,32 --dataset gsm8k,humaneval,mt-bench \
        --num-prompts 64 --max-tokens 256 --repeats 3 --out-dir benchmarks/results/sweep_smollm2
    # another OpenAI server (a method name is then only a label):
    dspark bench sweep --methods llama.cpp --server-cmd 'llama-server -m M.gguf --port {port}' ...

Per method (names: see `dspark.bench.methods`): start `python -m dspark serve MODEL --port P
--speculative-config JSON [--engine-args ...]` on 127.0.0.1 and a free port, wait for /health, run
`run_bench` for every dataset × concurrency × repeat (each point on prompts no earlier point served,
the same for every method; `--reuse-prompts`: the same first prompts everywhere), stop the server
(SIGTERM, then SIGKILL after a timeout). With `--interleave` every method's server is up at once
and the points run repeat by repeat, dataset by dataset, concurrency by concurrency, the methods in
turn: the compared methods are then measured seconds apart instead of minutes, which matters on a
machine whose speed drifts (an idle server sleeps: it takes no CPU while another is measured).
Methods that need a drafter checkpoint take it from `--drafter-dir METHOD=PATH` or
`dspark.drafters.shipped`, else they are skipped with a message.
Length policies prefix/async get a cost table that `dspark profile` writes once per drafter method
into the out dir (`cost_table_<method>.json`, reused when present, or `--cost-table PATH`).

Writes into --out-dir: results.json (command, date, machine, every point, the averaged table),
report.md, pareto_<dataset>.png, tpot_vs_concurrency.png, tau_by_dataset.png,
verify_budget_vs_concurrency.png, raw/<method>_<dataset>_c<C>_r<R>.json (per-request records),
logs/ (server and profile output). The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import fields
from functools import cache
from pathlib import Path

from dspark.bench.client import BenchConfig
from dspark.bench.methods import (Method, MethodUnavailable, method_spec, parse_drafter_dirs,
                                  parse_method, shipped_drafter_dir)
from dspark.bench.report import json_safe, run_info
from dspark.bench.server_proc import ServerError, ServerProcess, log_tail
from dspark.bench.sweep_report import report_header, safe_name, write_report

POINT_KEYS = ("num_requests", "num_completed", "num_failed", "duration_s", "total_input_tokens",
              "total_output_tokens", "request_throughput_req_s", "output_throughput_tok_s",
              "per_user_output_tok_s", "mean_tokens_per_chunk", "mean_ttft_ms", "median_ttft_ms",
              "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
              "mean_e2el_ms", "first_error")


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in _csv(text)]


def register(subparsers) -> argparse.ArgumentParser:
    from dspark.config import DEFAULT_MODEL

    d = {f.name: f.default for f in fields(BenchConfig)}
    p = subparsers.add_parser("sweep", help="serve methods in turn and benchmark a grid",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="target model given to `dspark serve`")
    p.add_argument("--methods", type=_csv, default=["none", "ngram"],
                   help="comma list: none, ngram[-kN], dspark[-kN][-POLICY][-lookup], dflash, eagle3, ...")
    p.add_argument("--concurrency", type=_csv_ints, default=[1, 4, 8, 16, 32])
    p.add_argument("--dataset", type=_csv, default=["gsm8k"], help="comma list of datasets")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--num-prompts-per-concurrency", type=int, default=0,
                   help="at least this many prompts per concurrency slot (0: off)")
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"])
    p.add_argument("--ignore-eos", action="store_true", help="fixed output length: max-tokens")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--drafter-dir", action="append", default=[], metavar="METHOD=PATH",
                   help="drafter checkpoint per method base (dspark=PATH) or full name")
    p.add_argument("--cost-table", default=None, help="use this table instead of profiling")
    p.add_argument("--engine-args", default="",
                   help="extra engine flags for serve and profile, e.g. '--num-threads 4'")
    p.add_argument("--profile-args", default="", help="extra flags for `dspark profile`")
    p.add_argument("--server-cmd", default=None,
                   help="serve with this command instead (placeholders {port}, {model}, "
                        "{speculative_config}); method names become labels")
    p.add_argument("--endpoint", choices=("chat", "completions"), default=d["endpoint"])
    p.add_argument("--temperature", type=float, default=d["temperature"])
    p.add_argument("--num-warmup", type=int, default=d["num_warmup"])
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--random-input-len", type=int, default=d["random_input_len"])
    p.add_argument("--request-timeout-s", type=float, default=d["request_timeout_s"])
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--interleave", action="store_true",
                   help="all servers up at once; the methods take turns at every grid point")
    p.add_argument("--reuse-prompts", action="store_true",
                   help="every point draws the same first prompts (the older sweeps' method); default: "
                        "each dataset x concurrency x repeat point (and its warm-up) takes prompts no "
                        "earlier point served, the same for every method, so no server's prefix or "
                        "cross-request lookup cache holds a measured prompt's answer")
    p.set_defaults(func=run_cli)
    return p


def server_argv(args: argparse.Namespace, spec: dict | None) -> list[str]:
    """The command that serves `args.model` with `spec` on port `{port}`."""
    spec_json = "none" if spec is None else json.dumps(spec, separators=(",", ":"))
    if args.server_cmd:
        return [a.replace("{model}", args.model).replace("{speculative_config}", spec_json)
                for a in shlex.split(args.server_cmd)]
    return [sys.executable, "-m", "dspark", "serve", args.model, "--port", "{port}",
            "--host", "127.0.0.1", "--log-level", "warning", "--speculative-config", spec_json,
            *shlex.split(args.engine_args)]


def ensure_cost_table(args: argparse.Namespace, spec: dict, out_dir: Path) -> str:
    """A cost table for the drafter in `spec`: --cost-table, a previous one, or `dspark profile`."""
    if args.cost_table:
        return args.cost_table
    path = out_dir / f"cost_table_{spec['method']}.json"
    if path.is_file():
        return str(path)
    profile_spec = {k: v for k, v in spec.items() if k not in ("length_policy", "cost_table")}
    argv = [sys.executable, "-m", "dspark", "profile", args.model, "--out", str(path),
            "--speculative-config", json.dumps(profile_spec), *shlex.split(args.engine_args),
            *shlex.split(args.profile_args)]
    log = out_dir / "logs" / f"profile_{spec['method']}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[sweep] profiling the cost table: {shlex.join(argv)}", file=sys.stderr)
    with open(log, "wb") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not path.is_file():
        raise MethodUnavailable(f"`dspark profile` failed (exit {rc}):\n{log_tail(log)}")
    return str(path)


def resolve_spec(args: argparse.Namespace, method: Method, drafter_dirs: dict[str, str],
                 out_dir: Path) -> dict | None:
    """The speculative config of one method; raises MethodUnavailable when it cannot run."""
    drafter = None
    if method.needs_drafter:
        drafter = (drafter_dirs.get(method.name) or drafter_dirs.get(method.base)
                   or shipped_drafter_dir(args.model, method.base))
    spec = method_spec(method, drafter_dir=drafter, cost_table_path="<pending>")
    if method.needs_cost_table:
        spec["cost_table"] = ensure_cost_table(args, spec, out_dir)
    return spec


# a bench run's (vLLM's) key → the sweep point's
RUN_TO_POINT = {"completed": "num_completed", "failed": "num_failed", "duration": "duration_s",
                "request_throughput": "request_throughput_req_s", "output_throughput": "output_throughput_tok_s"}


def to_point(result: dict, *, method: str, dataset: str, concurrency: int, repeat: int) -> dict:
    """One results.json point: the aggregate metrics plus τ and verify budget from /metrics."""
    renamed = {RUN_TO_POINT.get(k, k): v for k, v in result.items()}
    spec = {k: v for k, v in result.items() if k.startswith("spec_decode_")}
    point = {"method": method, "dataset": dataset, "max_concurrency": concurrency,
             "repeat": repeat, **{k: renamed.get(k) for k in POINT_KEYS}}
    point["tau"] = spec.get("spec_decode_acceptance_length")
    rate = spec.get("spec_decode_acceptance_rate")
    point["acceptance_rate"] = None if rate is None else rate / 100.0
    point["mean_verify_budget"] = spec.get("spec_decode_mean_verify_budget")
    point["spec_decode"] = spec or None
    return point


def point_num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.num_prompts, args.num_prompts_per_concurrency * concurrency)


def prompt_offsets(args: argparse.Namespace) -> dict[tuple[str, int, int], int]:
    """(dataset, concurrency, repeat) → where the point's prompts start in the seed's order: each point
    takes the next unused slice (its measured prompts, then its warm-up). Raises SystemExit when a
    dataset has too few rows. Computed once per grid (every point asks)."""
    sizes = tuple((c, point_num_prompts(args, c)) for c in args.concurrency)
    return _prompt_offsets(tuple(args.dataset), sizes, args.repeats, args.num_warmup, args.seed)


@cache
def _prompt_offsets(datasets: tuple[str, ...], sizes: tuple[tuple[int, int], ...], repeats: int,
                    num_warmup: int, seed: int) -> dict[tuple[str, int, int], int]:
    from dspark.bench.datasets import RANDOM_DATASET, load_prompts

    offsets, need = {}, {}
    for d in datasets:
        used = 0
        for r in range(repeats):
            for c, num_prompts in sizes:
                offsets[d, c, r] = used
                used += num_prompts + num_warmup
        need[d] = used
    for d, used in need.items():
        if d != RANDOM_DATASET and used > (rows := len(load_prompts(d, None, seed))):
            raise SystemExit(f"error: fresh prompts for every point need {used} prompts of {d!r}, which has "
                             f"{rows}: lower --num-prompts / --repeats / --concurrency, or pass --reuse-prompts")
    return offsets


def bench_point(args: argparse.Namespace, name: str, base_url: str, out_dir: Path, *, dataset: str,
                concurrency: int, repeat: int) -> dict:
    """One dataset × concurrency × repeat point against a running server."""
    from dspark.bench.cli import run_bench

    num_prompts = point_num_prompts(args, concurrency)
    raw = out_dir / "raw" / f"{safe_name(name)}_{safe_name(dataset)}_c{concurrency}_r{repeat}.json"
    cfg = BenchConfig(
        base_url=base_url, endpoint=args.endpoint, dataset=dataset,
        num_prompts=num_prompts, max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos, max_concurrency=concurrency,
        num_warmup=args.num_warmup, seed=args.seed, result_file=str(raw),
        prompt_offset=0 if args.reuse_prompts else prompt_offsets(args)[dataset, concurrency, repeat],
        temperature=args.temperature, random_input_len=args.random_input_len,
        request_timeout_s=args.request_timeout_s, disable_tqdm=True, label=name)
    try:
        point = to_point(run_bench(cfg), method=name, dataset=dataset,
                         concurrency=concurrency, repeat=repeat)
        point["raw_file"] = str(raw.relative_to(out_dir))
    except Exception as e:  # noqa: BLE001 - one failed point must not end the sweep
        point = {"method": name, "dataset": dataset, "max_concurrency": concurrency,
                 "repeat": repeat, "error": f"{type(e).__name__}: {e}"}
    print(f"[sweep] {name} {dataset} c={concurrency} r={repeat}: "
          f"{_point_line(point)}", file=sys.stderr, flush=True)
    return point


def bench_method(args: argparse.Namespace, name: str, base_url: str, out_dir: Path) -> list[dict]:
    """Every dataset × concurrency × repeat against one running server."""
    return [bench_point(args, name, base_url, out_dir, dataset=d, concurrency=c, repeat=r)
            for d in args.dataset for c in args.concurrency for r in range(args.repeats)]


def bench_interleaved(args: argparse.Namespace, base_urls: dict[str, str], out_dir: Path) -> list[dict]:
    """Repeat by repeat, dataset by dataset, concurrency by concurrency: every method in turn, the turn
    order rotated by one method at each point, so no method always runs first or right after another
    (the machine's state after a heavy method's point would otherwise fall on the same one each time)."""
    names = list(base_urls)
    grid = [(r, d, c) for r in range(args.repeats) for d in args.dataset for c in args.concurrency]
    return [bench_point(args, name, base_urls[name], out_dir, dataset=d, concurrency=c, repeat=r)
            for i, (r, d, c) in enumerate(grid)
            for name in names[i % len(names):] + names[:i % len(names)]]


def _point_line(point: dict) -> str:
    if point.get("error"):
        return f"ERROR {point['error'][:200]}"
    tput, tpot, tau = (point.get("output_throughput_tok_s"), point.get("mean_tpot_ms"),
                       point.get("tau"))
    return (f"{tput or 0:.1f} tok/s, TPOT {tpot or 0:.1f} ms"
            + (f", tau {tau:.2f}" if tau is not None else ""))


def summary(results: dict) -> dict:
    """The last-line JSON: counts, skipped methods and per dataset × method peak throughput."""
    peak: dict[str, dict[str, float]] = {}
    for row in results["table"]:
        by_method = peak.setdefault(row["dataset"], {})
        value = row.get("output_throughput_tok_s") or 0.0
        by_method[row["method"]] = round(max(by_method.get(row["method"], 0.0), value), 2)
    return {"bench": "serve_sweep", "out_dir": results["out_dir"],
            "num_points": len(results["points"]),
            "num_failed_points": sum(1 for p in results["points"] if p.get("error")),
            "methods": list(results["servers"]), "skipped": results["skipped"],
            "peak_output_tok_s": peak}


def _server_for(args: argparse.Namespace, name: str, drafter_dirs: dict[str, str], out_dir: Path,
                results: dict) -> tuple[ServerProcess | None, dict | None]:
    """The (not yet started) server of one method and its speculative config; (None, None) when the
    method is skipped (recorded in results["skipped"])."""
    try:
        spec = resolve_spec(args, parse_method(name), drafter_dirs, out_dir)
    except ValueError as e:
        if not args.server_cmd:
            raise SystemExit(f"error: {e}")
        spec = None  # an external server: the name is only a label
    except MethodUnavailable as e:
        print(f"[sweep] skipping {name}: {e}", file=sys.stderr)
        results["skipped"][name] = str(e)
        return None, None
    return ServerProcess(server_argv(args, spec), log_path=out_dir / "logs" / f"server_{safe_name(name)}.log",
                         start_timeout_s=args.start_timeout_s), spec


def run_cli(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drafter_dirs = parse_drafter_dirs(args.drafter_dir)
    if not args.reuse_prompts:
        prompt_offsets(args)  # enough rows for fresh prompts everywhere: fail before any server starts
    results: dict = {"bench": "serve_sweep", **run_info(), "model": args.model,
                     "out_dir": str(out_dir),
                     "config": {k: v for k, v in vars(args).items()
                                if k not in ("func", "command", "bench_command")},
                     "skipped": {}, "servers": {}, "points": []}
    with ExitStack() as live:  # --interleave: every server stays up until all points ran
        base_urls: dict[str, str] = {}
        for name in args.methods:
            server, spec = _server_for(args, name, drafter_dirs, out_dir, results)
            if server is None:
                continue
            print(f"[sweep] starting {name}: {shlex.join(server.argv)}", file=sys.stderr, flush=True)
            try:
                with ExitStack() as this:
                    this.enter_context(server)
                    results["servers"][name] = {"argv": server.argv, "speculative_config": spec,
                                                "startup_s": server.startup_s,
                                                "log": str(server.log_path.relative_to(out_dir))}
                    if args.interleave:
                        base_urls[name] = server.base_url
                        live.enter_context(this.pop_all())
                    else:
                        results["points"] += bench_method(args, name, server.base_url, out_dir)
            except ServerError as e:
                print(f"[sweep] {name}: {e}", file=sys.stderr)
                results["skipped"][name] = f"server failed: {str(e).splitlines()[0]}"
        if base_urls:
            results["points"] += bench_interleaved(args, base_urls, out_dir)
    written = write_report(results["points"], out_dir, header=report_header(results),
                           skipped=results["skipped"])
    results["table"] = written["rows"]
    (out_dir / "results.json").write_text(
        json.dumps(json_safe(results), indent=2, allow_nan=False) + "\n")
    print(json.dumps(json_safe(summary(results)), allow_nan=False), flush=True)
    ok = any(not p.get("error") for p in results["points"])
    return 0 if ok else 1
