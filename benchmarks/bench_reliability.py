"""Reliability benchmarks against a real `dspark serve` process (the default model and drafter unless
told otherwise), each writing one JSON file:

    python benchmarks/bench_reliability.py fuzz  --num-requests 10000 --out benchmarks/results/reliability_fuzz.json
    python benchmarks/bench_reliability.py soak  --num-requests 1000 --concurrency 32 --abort-frac 0.3 --out ...
    python benchmarks/bench_reliability.py flood --num-requests 2000 --max-num-waiting 64 --out ...
    python benchmarks/bench_reliability.py abuse --out benchmarks/results/reliability_abuse.json

- fuzz: generated hostile requests (wrong types, huge and non-finite numbers, invalid UTF-8, lone
  surrogates, deep nesting, wrong content types, oversized bodies, lengths past the context, unknown
  models and routes) mixed with small valid ones, 8 at a time; counts statuses (the bar: 0 5xx), then
  checks the server is alive and /metrics shows running, waiting and KV usage at 0.
- soak: requests at a fixed concurrency, streamed and not, `abort_frac` of the clients leave at a
  random point (a stream closed after a random number of chunks, a non-streaming client timing out);
  RSS after the warm-up vs at the end, 5xx, leaks; then an accounting phase (no aborts) whose usage sums
  must equal the Prometheus counters exactly.
- flood: every request at once against `--max-num-waiting`; 429s counted, peak RSS, and every admitted
  request must complete.
- abuse: the worst single request of each hostile class (request templates that expand, allocate or loop; a
  schema with no value; a strict catastrophic pattern; 256-prompt batches, kept and left; an echo with prompt
  logprobs of a 7.9k-token prompt): the server's RSS after it against after a warm-up, and a 4-token probe's
  median latency while it runs (the cheap ones repeated) from another client against idle (targets: RSS <= 1.5x,
  probe <= 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dspark.bench.report import run_info, write_result_file

J = {"content-type": "application/json"}


# -- the server process ----------------------------------------------------------------------------
class Server:
    def __init__(self, extra: list[str], log_path: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "dspark", "serve", "--port", str(self.port), "--log-level",
               "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {log_path}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not come up")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
                key = s.name + ("" if not labels else json.dumps(labels, sort_keys=True))
                out[key] = s.value
        return out

    def idle(self, timeout_s: float = 120) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            zero = all(m.get(f"vllm:{k}", 1) == 0 for k in
                       ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
            if zero or time.monotonic() > deadline:
                return {"running": m.get("vllm:num_requests_running"),
                        "waiting": m.get("vllm:num_requests_waiting"),
                        "kv_cache_usage": m.get("vllm:kv_cache_usage_perc"), "clean": zero}
            time.sleep(0.5)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9
        finally:
            self.log.close()


# -- fuzz ------------------------------------------------------------------------------------------
def _rand_value(rng: random.Random, depth: int = 0):
    kinds = [
        lambda: None, lambda: rng.random() < 0.5, lambda: rng.randint(-2**70, 2**70),
        lambda: rng.choice([0, -1, 1, 2**31, 2**63, 10**30]), lambda: rng.uniform(-1e300, 1e300),
        lambda: "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(5)),
        lambda: rng.choice(["", "x", "0", "1e999", "NaN"]),
        lambda: [rng.randrange(-5, 200_000) for _ in range(rng.randrange(4))],
        lambda: [_rand_value(rng, depth + 1) for _ in range(rng.randrange(3))],
        lambda: {str(rng.randrange(9)): _rand_value(rng, depth + 1)}]
    return kinds[rng.randrange(len(kinds) if depth < 3 else len(kinds) - 2)]()


FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "seed", "stop",
          "stop_token_ids", "n", "stream", "stream_options", "ignore_eos", "model", "prompt",
          "messages", "speculation", "include_stop_str_in_output"]


def hostile_request(rng: random.Random, model: str, max_model_len: int, body_limit: int):
    """(path, body bytes, headers): one generated request; about 1 in 8 is a small valid one."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = ({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            if chat else {"model": model, "prompt": "hi", "max_tokens": 2})
    kind = rng.randrange(16)
    if kind == 0:
        return path, json.dumps(base).encode(), J  # valid
    if kind <= 5:  # fields of random type and size
        body = dict(base)
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FIELDS)] = _rand_value(rng)
        return path, json.dumps(body).encode(), J
    if kind == 6:
        return path, json.dumps({**base, "max_tokens": max_model_len * rng.randint(1, 10**6)}).encode(), J
    if kind == 7:
        key = "messages" if chat else "prompt"
        big = "w " * rng.randint(max_model_len, 4 * max_model_len)
        value = [{"role": "user", "content": big}] if chat else big
        return path, json.dumps({**base, key: value}).encode(), J
    if kind == 8:
        return path, json.dumps(base).encode()[:-1] + bytes([rng.randrange(128, 256)]) + b"}", J
    if kind == 9:
        return path, json.dumps(base).replace('"hi"', '"a\\ud800"').encode(), J
    if kind == 10:
        depth = rng.randint(33, 5000)
        return path, (b'{"model": "x", "prompt": ' + b"[" * depth + b"]" * depth + b"}"), J
    if kind == 11:
        return path, json.dumps(base).encode(), rng.choice(
            [{}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}])
    if kind == 12:
        return path, b'{"prompt": "' + b"x" * (body_limit + 1) + b'"}', J
    if kind == 13:
        return path, json.dumps({**base, "model": "no-such-model"}).encode(), J
    if kind == 14:
        return rng.choice(["/v1/nothing", "/v1/completions/x", "/admin"]), b"{}", J
    return path, rng.choice([b"", b"null", b"[]", b"{", b'{"prompt": NaN}', b"\xff\xfe"]), J


async def run_fuzz(server: Server, n: int, seed: int, model: str, body_limit: int,
                   timeout_s: float = 600) -> dict:
    rng = random.Random(seed)
    max_model_len = httpx.get(server.base + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    statuses: dict[str, int] = {}
    five: list[dict] = []
    slow: list[dict] = []  # transport errors (a valid request generating past the client timeout)
    sem = asyncio.Semaphore(8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=16)) as client:
        async def one(i: int):
            path, body, headers = hostile_request(rng, model, max_model_len, body_limit)
            async with sem:
                try:
                    r = await client.post(server.base + path, content=body, headers=headers)
                    code = str(r.status_code)
                    if r.status_code >= 500:
                        five.append({"path": path, "body": body[:300].decode("latin-1"),
                                     "status": r.status_code, "text": r.text[:300]})
                except httpx.HTTPError as e:
                    code = f"transport:{type(e).__name__}"
                    slow.append({"path": path, "body": body[:300].decode("latin-1"), "error": code})
            statuses[code] = statuses.get(code, 0) + 1
        await asyncio.gather(*(one(i) for i in range(n)))
    return {"statuses": dict(sorted(statuses.items())), "num_5xx": len(five), "examples_5xx": five[:10],
            "client_timeout_s": timeout_s, "transport_errors": slow[:20]}


# -- soak and flood --------------------------------------------------------------------------------
def _payload(rng: random.Random, model: str, stream: bool) -> dict:
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 24),
            "temperature": rng.choice([0.0, 0.0, 0.7]), "ignore_eos": rng.random() < 0.5}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three prime numbers:", "Once upon a time", "Q: What is 12 * 7? A:",
           "Translate to French: good morning", "The quick brown fox"]


async def one_request(client, base: str, body: dict, abort_after: int | None,
                      timeout_s: float | None) -> dict:
    """abort_after: close a stream after this many events; timeout_s: a non-streaming client that
    gives up. Returns status, usage (None when aborted) and whether it was aborted."""
    path = base + "/v1/completions"
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as r:
                usage, seen = None, 0
                if r.status_code != 200:
                    await r.aread()
                    return {"status": r.status_code, "usage": None, "aborted": False}
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    seen += 1
                    if abort_after is not None and seen >= abort_after:
                        return {"status": 200, "usage": None, "aborted": True}
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {"status": chunk["error"]["code"], "usage": None, "aborted": False}
                    usage = chunk.get("usage") or usage
                return {"status": 200, "usage": usage, "aborted": False}
        r = await client.post(path, json=body, timeout=timeout_s or 600)
        return {"status": r.status_code, "usage": r.json().get("usage") if r.status_code == 200
                else None, "aborted": False}
    except httpx.TimeoutException:
        return {"status": 0, "usage": None, "aborted": True}


async def run_batch(server: Server, bodies: list, concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as c:
        async def go(item):
            async with sem:
                return await one_request(c, server.base, *item)
        return await asyncio.gather(*(go(item) for item in bodies))


def _plan(rng: random.Random, n: int, model: str, abort_frac: float) -> list:
    plan = []
    for _ in range(n):
        stream = rng.random() < 0.6
        aborts = rng.random() < abort_frac
        abort_after = rng.randint(1, 6) if aborts and stream else None
        timeout_s = rng.uniform(0.05, 1.5) if aborts and not stream else None
        plan.append((_payload(rng, model, stream), abort_after, timeout_s))
    return plan


def _accounting(before: dict, after: dict, results: list[dict]) -> dict:
    usages = [r["usage"] for r in results if r["usage"]]
    pairs = {
        "generation_tokens": ("vllm:generation_tokens_total", sum(u["completion_tokens"] for u in usages)),
        "prompt_tokens": ("vllm:prompt_tokens_total", sum(
            u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usages)),
        **{name: (f"vllm:spec_decode_{name}_total", sum(u["spec"][name] for u in usages))
           for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}}
    table = {k: {"counter": after.get(m, 0) - before.get(m, 0), "usage_sum": s} for k, (m, s) in pairs.items()}
    return {"num_requests": len(usages), "counters": table,
            "equal": all(v["counter"] == v["usage_sum"] for v in table.values())}


def _statuses(results: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        key = "aborted" if r["aborted"] else str(r["status"])
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def run_soak(server: Server, n: int, concurrency: int, abort_frac: float, seed: int, model: str,
             accounting_n: int) -> dict:
    rng = random.Random(seed)
    warm = min(max(n // 10, concurrency), n)
    start = time.perf_counter()
    results = asyncio.run(run_batch(server, _plan(rng, warm, model, abort_frac), concurrency))
    server.idle()
    rss_warm = server.rss_mib()
    results += asyncio.run(run_batch(server, _plan(rng, n - warm, model, abort_frac), concurrency))
    soak_s = time.perf_counter() - start
    after_soak = server.idle()
    rss_end = server.rss_mib()
    before = server.metrics()
    acct = asyncio.run(run_batch(server, _plan(rng, accounting_n, model, 0.0), concurrency))
    server.idle()
    return {"num_requests": n, "concurrency": concurrency, "abort_frac": abort_frac,
            "seconds": round(soak_s, 1), "statuses": _statuses(results),
            "num_5xx": sum(1 for r in results if r["status"] >= 500),
            "num_aborted": sum(r["aborted"] for r in results), "after": after_soak,
            "rss_after_warmup_mib": round(rss_warm, 1), "rss_end_mib": round(rss_end, 1),
            "rss_growth_frac": round(rss_end / rss_warm - 1, 4),
            "accounting": _accounting(before, server.metrics(), acct)}


def run_flood(server: Server, n: int, seed: int, model: str) -> dict:
    rng = random.Random(seed)
    peak = [server.rss_mib()]
    done = [False]

    async def sample_rss():
        while not done[0]:
            peak.append(server.rss_mib())
            await asyncio.sleep(0.2)

    async def main():
        task = asyncio.create_task(sample_rss())
        plan = [(_payload(rng, model, rng.random() < 0.5) | {"max_tokens": 8}, None, None)
                for _ in range(n)]
        results = await run_batch(server, plan, n)
        done[0] = True
        await task
        return results

    start = time.perf_counter()
    results = asyncio.run(main())
    seconds = time.perf_counter() - start
    admitted = [r for r in results if r["status"] != 429]
    return {"num_requests": n, "seconds": round(seconds, 1), "statuses": _statuses(results),
            "num_429": len(results) - len(admitted), "num_admitted": len(admitted),
            "admitted_completed": sum(1 for r in admitted if r["status"] == 200 and r["usage"]),
            "num_5xx": sum(1 for r in results if r["status"] >= 500),
            "peak_rss_mib": round(max(peak), 1), "after": server.idle()}


# -- abuse: one client attacks, another probes ------------------------------------------------------
PROBE = {"prompt": "Hi", "max_tokens": 4, "temperature": 0.0}
LONG_PROMPT = " ".join(f"note {i}: the quick brown fox jumps over the lazy dog." for i in range(500))


def _attacks(model: str) -> dict[str, tuple[str, dict, float]]:
    """name -> (route, body, client timeout s): the worst single requests of each hostile class. The cheap ones
    (`REPEATED`) are sent again and again while the probes run; the heavy ones once, the probes starting 0.5 s
    after it."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16}

    def tool(params: dict, **kw) -> dict:
        return {"type": "function", "function": {"name": "f", "parameters": params, **kw}}
    pattern = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}, "required": ["s"]}
    return {
        "template_size": ("/v1/chat/completions", {**chat, "chat_template": "{{ 'x' * 50000000 }}"}, 60),
        "template_time": ("/v1/chat/completions", {**chat, "chat_template": "{% for i in range(100000) %}{% for j "
                                                   "in range(100000) %}{% endfor %}{% endfor %}"}, 60),
        "template_memory": ("/v1/chat/completions", {**chat, "chat_template": "{{ 'x' * 100000000000 }}"}, 60),
        "recursive_schema": ("/v1/chat/completions", {**chat, "tools": [tool({"$ref": "#"}, strict=True)],
                                                      "tool_choice": "required"}, 60),
        "strict_pattern_required": ("/v1/chat/completions", {**chat, "tools": [tool(pattern, strict=True)],
                                                             "tool_choice": "required", "max_tokens": 48}, 120),
        "batch_256": ("/v1/completions", {"model": model, "prompt": [f"Count to {i}:" for i in range(256)],
                                          "max_tokens": 16}, 600),
        "batch_256_disconnect": ("/v1/completions", {"model": model, "prompt": [f"Count to {i}:" for i in range(256)],
                                                     "max_tokens": 16}, 2),
        "echo_logprobs": ("/v1/completions", {"model": model, "prompt": LONG_PROMPT, "echo": True, "logprobs": 5,
                                              "prompt_logprobs": 20, "max_tokens": 1}, 120),
    }


REPEATED = ("template_size", "template_time", "template_memory", "recursive_schema", "strict_pattern_required")


def _send(server: Server, route: str, body: dict, timeout: float) -> str:
    try:
        return str(httpx.post(server.base + route, json=body, timeout=timeout).status_code)
    except httpx.TimeoutException:
        return "client timeout"


def _probes(server: Server, model: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        r = httpx.post(server.base + "/v1/completions", json={"model": model, **PROBE}, timeout=600)
        assert r.status_code == 200, r.text
        out.append(time.perf_counter() - start)
    return out


def run_abuse(server: Server, model: str, probes: int) -> dict:
    """Per attack: the status and the server's RSS after that one request (against the RSS after a warm-up), then
    the probe's median latency while the attack repeats from another client, against idle."""
    import statistics
    import threading
    for _ in range(3):
        _probes(server, model, 2)
    warm = server.rss_mib()
    idle = statistics.median(_probes(server, model, probes))
    out: dict = {"rss_warm_mib": round(warm, 1), "probe_idle_s": round(idle, 4), "attacks": {}}
    for name, (route, body, timeout) in _attacks(model).items():
        start = time.perf_counter()
        status = _send(server, route, body, timeout)
        seconds = time.perf_counter() - start
        server.idle()
        rss = server.rss_mib()
        stop = threading.Event()

        def repeat():
            while not stop.is_set():
                _send(server, route, body, timeout)
                if name not in REPEATED:
                    break
        attacker = threading.Thread(target=repeat, daemon=True)
        attacker.start()
        time.sleep(0.5)
        latencies = _probes(server, model, probes)
        under = statistics.median(latencies)
        stop.set()
        attacker.join()
        server.idle()
        out["attacks"][name] = {"status": status, "seconds": round(seconds, 2), "rss_after_mib": round(rss, 1),
                                "rss_ratio": round(rss / warm, 3), "repeated": name in REPEATED,
                                "probe_s": round(under, 4), "probe_ratio": round(under / idle, 2),
                                "probe_max_s": round(max(latencies), 3), "probe_max_ratio": round(max(latencies) / idle, 1)}
        print(name, out["attacks"][name], flush=True)
    out["worst_probe_ratio"] = max(a["probe_ratio"] for a in out["attacks"].values())
    out["worst_rss_ratio"] = max(a["rss_ratio"] for a in out["attacks"].values())
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["fuzz", "soak", "flood", "abuse"])
    p.add_argument("--probes", type=int, default=8, help="abuse: probe requests per measurement")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--abort-frac", type=float, default=0.3)
    p.add_argument("--accounting-requests", type=int, default=100)
    p.add_argument("--max-num-waiting", type=int, default=64)
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more `dspark serve` flags, one string")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    n = args.num_requests or {"fuzz": 10_000, "soak": 1000, "flood": 2000, "abuse": 0}[args.kind]
    extra = ["--max-num-waiting", str(args.max_num_waiting if args.kind == "flood" else 4096),
             "--max-request-body-bytes", str(args.max_request_body_bytes), *args.serve_args.split()]
    if args.kind == "flood":
        extra += ["--retry-after-s", "1"]
    if args.kind == "abuse":  # every surface on: request templates, strict tools
        extra += ["--trust-request-chat-template", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_reliability_{args.kind}.log"
    server = Server(extra, log_path)
    model = httpx.get(server.base + "/v1/models", timeout=30).json()["data"][0]["id"]
    result = {**run_info(argv), "kind": args.kind, "serve_args": extra, "rss_start_mib": round(server.rss_mib(), 1)}
    try:
        if args.kind == "fuzz":
            start = time.perf_counter()
            result |= asyncio.run(run_fuzz(server, n, args.seed, model, args.max_request_body_bytes))
            result |= {"num_requests": n, "seconds": round(time.perf_counter() - start, 1),
                       "after": server.idle(), "rss_end_mib": round(server.rss_mib(), 1)}
        elif args.kind == "soak":
            result |= run_soak(server, n, args.concurrency, args.abort_frac, args.seed, model,
                               args.accounting_requests)
        elif args.kind == "abuse":
            result |= run_abuse(server, model, args.probes)
        else:
            result |= run_flood(server, n, args.seed, model)
        result["alive"] = httpx.get(server.base + "/health", timeout=30).status_code == 200
    finally:
        result["exit_code_after_sigterm"] = server.stop()
    print(json.dumps({k: v for k, v in result.items() if k not in ("examples_5xx",)}, indent=1))
    if args.out:
        write_result_file(args.out, result)
    return result


if __name__ == "__main__":
    main()
