"""Replicas against one engine on the same cores, and a router's added latency; one JSON file.

    python benchmarks/bench_data_parallel.py --out benchmarks/results/data_parallel.json
    python benchmarks/bench_data_parallel.py --num-prompts 2 --concurrency 2 --out /tmp/dp_smoke.json  # smoke

Served throughput of the default model (or --model) at each --concurrency (default 16 and 32), side by side:
`dspark serve --data-parallel-size 2 --num-threads 1` (two engine processes, one core each, one API server)
against `dspark serve --num-threads 2` (one engine on both cores), each with the default speculation (the
shipped drafter) and plain (`--speculative-config none`). Each server is started once per (layout,
speculation) and measured at every concurrency with the same prompts (`dspark bench serve`'s client,
`--ignore-eos`, fixed output length). The summary gives each pair's output-throughput ratio (replicas / one).

Router: with `vllm-router` on PATH (or --router PATH), two `dspark serve --num-threads 1` behind it, and the
time to first token at concurrency 1 through the router against straight to one of the servers, measured in
alternating rounds (target: router / direct <= 1.05). Without it the file says the router was not found.
Run on a quiet machine: the figures are only worth the machine's silence.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dspark.bench.client import BenchConfig
from dspark.bench.cli import run_bench
from dspark.bench.report import run_info, write_result_file
from dspark.bench.server_proc import ServerProcess, free_port

LAYOUTS = {  # name -> dspark serve flags
    "replicas_2x1": ["--data-parallel-size", "2", "--num-threads", "1"],
    "one_engine_2_threads": ["--num-threads", "2"],
}
SPECULATION = {"default": [], "plain": ["--speculative-config", "none"]}
KEYS = ("completed", "failed", "duration", "output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
        "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "spec_decode_acceptance_length")


def serve_argv(args, *flags: str) -> list[str]:
    model = [args.model] if args.model else []
    return [sys.executable, "-m", "dspark", "serve", *model, "--port", "{port}", "--log-level", "warning",
            "--disable-log-stats", *flags]


def bench(args, base_url: str, concurrency: int, num_prompts: int, offset: int = 0) -> dict:
    cfg = BenchConfig(base_url=base_url, dataset=args.dataset, num_prompts=num_prompts, max_tokens=args.max_tokens,
                      ignore_eos=True, max_concurrency=concurrency, num_warmup=args.num_warmup, seed=args.seed,
                      prompt_offset=offset, disable_tqdm=True, endpoint="completions")
    result = run_bench(cfg)
    return {k: result.get(k) for k in KEYS}


def throughput(args, logs: Path) -> list[dict]:
    rows = []
    for layout, layout_flags in LAYOUTS.items():
        for spec, spec_flags in SPECULATION.items():
            argv = serve_argv(args, *layout_flags, *spec_flags)
            with ServerProcess(argv, log_path=logs / f"{layout}_{spec}.log") as server:
                for c in args.concurrency:
                    row = {"layout": layout, "speculation": spec, "concurrency": c, "startup_s": server.startup_s,
                           **bench(args, server.base_url, c, args.num_prompts or 2 * c)}
                    print(f"[dp] {layout:22s} {spec:8s} c={c:3d}: {row['output_throughput']:.1f} tok/s", flush=True)
                    rows.append(row)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Replicas / one engine output throughput for each speculation and concurrency."""
    out = []
    by = {(r["layout"], r["speculation"], r["concurrency"]): r for r in rows}
    for (layout, spec, c), row in by.items():
        if layout != "replicas_2x1":
            continue
        one = by.get(("one_engine_2_threads", spec, c))
        if one and one["output_throughput"]:
            out.append({"speculation": spec, "concurrency": c, "replicas_tok_s": row["output_throughput"],
                        "one_engine_tok_s": one["output_throughput"],
                        "replicas_over_one": row["output_throughput"] / one["output_throughput"]})
    return out


def router_latency(args, logs: Path) -> dict:
    router = args.router or shutil.which("vllm-router")
    if router is None:
        return {"skipped": "vllm-router not found (pip install vllm-router, or --router PATH)"}
    servers = [ServerProcess(serve_argv(args, "--num-threads", "1"), log_path=logs / f"router_worker{i}.log")
               for i in range(2)]
    port = free_port()
    for s in servers:
        s.start()
    proc = None
    try:
        proc = subprocess.Popen([router, "--worker-urls", *[s.base_url for s in servers], "--port", str(port),
                                 "--policy", "cache_aware", "--worker-startup-check-interval", "1",
                                 "--log-level", "warning"], stdout=subprocess.DEVNULL,
                                stderr=open(logs / "router.log", "w"))
        _wait_answering(f"http://127.0.0.1:{port}/v1/models", proc)
        rounds = {"direct": [], "router": []}
        for r in range(args.router_rounds):
            for name, url in (("direct", servers[0].base_url), ("router", f"http://127.0.0.1:{port}")):
                rounds[name].append(bench(args, url, 1, args.router_prompts, offset=r * args.router_prompts))
        direct = statistics.median(x["median_ttft_ms"] for x in rounds["direct"])
        routed = statistics.median(x["median_ttft_ms"] for x in rounds["router"])
        return {"router": router, "policy": "cache_aware", "rounds": rounds, "median_ttft_ms_direct": direct,
                "median_ttft_ms_router": routed, "ttft_router_over_direct": routed / direct if direct else None}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        for s in servers:
            s.stop()


def _wait_answering(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    import time

    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"vllm-router did not answer at {url}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model to serve (default: dspark serve's default)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    p.add_argument("--num-prompts", type=int, default=None, help="requests per concurrency (default: 2 x c)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--num-warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router", default=None, help="vllm-router executable (default: on PATH)")
    p.add_argument("--router-prompts", type=int, default=16, help="requests per router / direct round")
    p.add_argument("--router-rounds", type=int, default=2)
    p.add_argument("--skip-router", action="store_true")
    p.add_argument("--out", default="benchmarks/results/data_parallel.json")
    p.add_argument("--log-dir", default=None, help="the servers' logs (default: a temporary folder)")
    args = p.parse_args()
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="dspark_bench_dp_"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[dp] server logs in {logs}", flush=True)
    rows = throughput(args, logs)
    result = {**run_info(), "rows": rows, "summary": summary(rows),
              "router": {"skipped": "--skip-router"} if args.skip_router else router_latency(args, logs)}
    write_result_file(args.out, result)
    for s in result["summary"]:
        print(f"[dp] {s['speculation']:8s} c={s['concurrency']:3d}: replicas / one = {s['replicas_over_one']:.2f}")
    if "ttft_router_over_direct" in result["router"]:
        print(f"[dp] router TTFT / direct at c=1: {result['router']['ttft_router_over_direct']:.3f}")
    print(f"[dp] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
