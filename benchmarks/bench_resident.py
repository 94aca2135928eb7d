"""Resident memory of `dspark serve` on a GGUF, and batch-1 decode, with the working tree's code beside a git
revision's (before weights stayed quantized), side by side in one run.

RSS: one `python -m dspark serve MODEL` per code revision (the shipped speculative default where the model
has one), warmed up with chat completions, then, 2 s later (the idle server has trimmed its heap), VmRSS /
RssAnon / RssFile of the server process read from /proc; the budget is 1.3 x the GGUF's size + the KV pool
(--kv-cache-memory-gb) + 300 MB runtime.
llama.cpp's RSS on the same file beside it when llama-cpp-python is installed (PEERS=1 scripts/setup.sh).
Decode: bench_decode.py's batch-1 greedy decode (plain, or with --spec the shipped speculative default;
--matmul-dtype auto) in one child process per revision, alternating, `--rounds` times; tok/s medians and
work ÷ base. `--rss-of ""` skips the serve RSS.

    DSPARK_DATASETS=../shared/datasets python benchmarks/bench_resident.py --base e7cc629 --rounds 4 --num-prompts 2 --out benchmarks/results/resident_default_q8_head.json
    python benchmarks/bench_resident.py --models default,gemma-3-270m --rounds 0 --out benchmarks/results/resident_memory_vs_llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 2**20
SETTLE_S = 2.0  # after the warm-ups, before RSS is read

DECODE_CHILD = """
import json, sys, torch
sys.path.insert(0, {bench_dir!r})
from bench_decode import bench_dspark, prompts
from dspark.engine.build import resolve_matmul_dtype
from dspark.models.loader import resolve_model_path
from dspark.models.tokenizer import load_tokenizer
tok = load_tokenizer(resolve_model_path("default"))
chat_ids = [tok.apply_chat_template([{{"role": "user", "content": p}}]) for p in prompts({num_prompts}, "gsm8k,humaneval")]
print(json.dumps(bench_dspark(chat_ids, resolve_matmul_dtype("auto", model="default"), spec={spec})))
"""


def checkout(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` extracted under `into` (no worktree is registered)."""
    archive = into / "rev.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process, in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def serve_rss(tree: Path, model: str, kv_gb: float, warmup: int, timeout: float) -> dict:
    """Start `dspark serve` from `tree`, wait for /health, send `warmup` chat requests, read its RSS."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "dspark", "serve", model, "--port", str(port), "--kv-cache-memory-gb", str(kv_gb)]
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > timeout:
                raise RuntimeError("serve did not come up")
            time.sleep(2)
        startup = time.time() - t0
        for i in range(warmup):
            text = f"Count to {5 + i} and explain."
            try:
                _post(port, "/v1/chat/completions", {"model": model, "max_tokens": 64, "temperature": 0,
                                                     "messages": [{"role": "user", "content": text}]})
            except urllib.error.HTTPError:  # a base model (no chat template): a plain completion
                _post(port, "/v1/completions", {"model": model, "max_tokens": 64, "temperature": 0, "prompt": text})
        time.sleep(SETTLE_S)  # an idle server hands the requests' freed memory back (async_engine.IDLE_TRIM_S)
        return {"startup_s": round(startup, 1), **proc_status(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def llama_cpp_rss(model_path: Path) -> dict | None:
    """llama.cpp's RSS (llama-cpp-python, mmap off so the weights count as its own) after a short generation:
    its defaults (runtime weight repacking on), or without repacking where that crashes (the default model's
    Q4_1 file: dspark.bench.peers.llama_without_repack)."""
    for repack in (True, False):
        make = "llama_cpp.Llama" if repack else "llama_without_repack"
        code = ("import json, llama_cpp; from dspark.bench.peers import llama_without_repack; "
                f"m = {make}(model_path=%r, n_ctx=2048, use_mmap=False, verbose=False); "
                "m('Count to ten.', max_tokens=64); print(json.dumps(open('/proc/self/status').read()))" % str(model_path))
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        except subprocess.TimeoutExpired:
            continue
        if out.returncode == 0:
            status = json.loads(out.stdout.strip().splitlines()[-1])
            return {"weight_repacking": repack, **{k: int(v.split()[0]) / 1024 for k, _, v in
                                                   (line.partition(":") for line in status.splitlines())
                                                   if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}}
    return None


def decode_rates(tree: Path, num_prompts: int, spec: bool = False) -> list[float]:
    code = DECODE_CHILD.format(bench_dir=str(tree / "benchmarks"), num_prompts=num_prompts, spec=spec)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tree, check=True,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=None, help="git revision to compare against (dense fp32 copies); "
                    "none: this tree (and llama.cpp) only")
    ap.add_argument("--models", default="default", help="comma list of GGUF files or model names")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=0.25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="decode rounds (0: no decode comparison)")
    ap.add_argument("--num-prompts", type=int, default=1, help="decode prompts per dataset")
    ap.add_argument("--spec", action="store_true", help="decode with the shipped speculative default, not plain")
    ap.add_argument("--rss-of", default="work,base", help="which revisions' serve RSS to measure")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from dspark.bench.report import run_info, write_result_file
    from dspark.models.loader import resolve_model_path
    result: dict = {"base": args.base, "kv_cache_memory_gb": args.kv_cache_memory_gb, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"work": ROOT, **({"base": checkout(args.base, Path(tmp))} if args.base else {})}
        for model in args.models.split(","):
            path = resolve_model_path(model)
            size_mb = path.stat().st_size / MB
            budget = 1.3 * size_mb + args.kv_cache_memory_gb * 1024 + 300
            entry = {"gguf_mb": round(size_mb, 1), "budget_mb": round(budget, 1)}
            for tag, tree in trees.items():
                if tag not in args.rss_of.split(","):
                    continue
                entry[tag] = serve_rss(tree, model, args.kv_cache_memory_gb, args.warmup, timeout=1800)
                print(tag, model, entry[tag], flush=True)
            if "work" in entry:
                entry["work_within_budget"] = entry["work"]["VmRSS"] <= budget
            entry["llama_cpp"] = llama_cpp_rss(path)
            if entry["llama_cpp"] and "work" in entry:
                entry["work_over_llama_cpp_rss"] = round(entry["work"]["VmRSS"] / entry["llama_cpp"]["VmRSS"], 2)
            print("llama.cpp", model, entry["llama_cpp"], flush=True)
            result["models"][model] = entry
        if args.rounds and args.base:
            rates: dict[str, list[float]] = {"work": [], "base": []}
            for r in range(args.rounds):
                for tag in (("work", "base") if r % 2 == 0 else ("base", "work")):
                    rates[tag].append(statistics.median(decode_rates(trees[tag], args.num_prompts, args.spec)))
                    print(tag, "decode tok/s", rates[tag][-1], flush=True)
            med = {tag: statistics.median(v) for tag, v in rates.items()}
            result["decode"] = {"spec": args.spec, "per_round_median_tok_s": rates, "median_tok_s": med,
                                "work_over_base": round(med["work"] / med["base"], 3)}
    result["run"] = run_info()
    print(json.dumps(result))
    if args.out:
        write_result_file(args.out, result)


if __name__ == "__main__":
    main()
