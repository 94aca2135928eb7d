"""dspark as a router's backend. What the routers send and read, checked on a served engine: the body
vllm-router forwards (it adds SGLang's fields at their defaults), `/health` as their start-up and runtime
probe, `/get_load` as power_of_two reads it (`{"load": N}`), and `/metrics` parsed as the Gateway API Inference
Extension's model server protocol states it (TotalQueuedRequests `vllm:num_requests_waiting`,
TotalRunningRequests `vllm:num_requests_running`, KVCacheUtilization `vllm:kv_cache_usage_perc`: gauges;
BlockSize / NumGPUBlocks: labels `block_size`, `num_gpu_blocks` of `vllm:cache_config_info`).

With `vllm-router` or `sglang-router` on PATH (pip install vllm-router / sglang-router; else skipped): two
`dspark serve` processes behind it on loopback answer every request with one engine's greedy output, and a server drained by SIGTERM finishes its
running request while the router sends the rest to the other."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import build_tiny_model, make_engine, serve

TESTS = Path(__file__).resolve().parent
# the bodies vllm-router forwards (captured from vllm-router 0.1.17): the client's fields and SGLang's defaults
ROUTER_COMPLETION = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0.0, "stream": False,
                     "echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                     "return_hidden_states": False}
ROUTER_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False, "max_tokens": 8,
               "logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False, "include_reasoning": True}
# the model server protocol's metrics (gateway-api-inference-extension, docs/proposals/003-model-server-protocol)
EPP_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def served():
    with serve(make_engine(build_tiny_model())) as s:
        yield s


@pytest.mark.parametrize("path, body", [("/v1/completions", ROUTER_COMPLETION), ("/v1/chat/completions", ROUTER_CHAT)])
def test_the_body_a_router_forwards_is_served(served, path, body):
    r = served.post(path, json=body)
    assert r.status_code == 200, r.text
    refused = served.post(path, json={**body, "no_stop_trim": True})  # a value that asks for something: named
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "no_stop_trim"


def test_health_and_load_probes(served):
    health = httpx.get(served.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    load = httpx.get(served.base_url + "/get_load", timeout=10).json()
    assert load == {"load": 0, "num_reqs": 0, "num_waiting_reqs": 0}


def test_metrics_as_the_inference_extension_reads_them(served):
    served.post("/v1/completions", json=ROUTER_COMPLETION)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(served.base_url + "/metrics").text)}
    for name in EPP_GAUGES:
        family = families[name]
        assert family.type == "gauge", (name, family.type)
        assert len(family.samples) == 1 and family.samples[0].name == name
    assert 0.0 <= families["vllm:kv_cache_usage_perc"].samples[0].value <= 1.0
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge"
    labels = info.samples[0].labels
    assert int(labels["block_size"]) == 4 and int(labels["num_gpu_blocks"]) == 96  # the harness's pool


# -- vllm-router in front of two dspark servers ---------------------------------------------------------------
# each router's command line (on PATH, else its test is skipped): policy power_of_two reads /get_load
ROUTERS = {"vllm-router": (shutil.which("vllm-router"), [], ["--policy", "power_of_two", "--log-level", "warning"]),
           "sglang-router": (shutil.which("sglang-router"), ["launch"], ["--policy", "cache_aware", "--log-level", "warn"])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, procs, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer")


def complete(url: str, prompt: str, max_tokens: int = 10) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


@pytest.mark.parametrize("name", list(ROUTERS))
def test_two_servers_behind_a_router(served, name):
    executable, command, flags = ROUTERS[name]
    if executable is None:
        pytest.skip(f"{name} is not installed (pip install {name})")
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    ports = [free_port(), free_port()]
    workers = [subprocess.Popen([sys.executable, str(TESTS / "serve_tiny.py"), str(p), "--step-sleep-s", "0.02"],
                                env=env, stderr=subprocess.DEVNULL) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    router_port = free_port()
    procs = list(workers)
    try:
        for url in urls:
            wait_ok(url + "/health", workers)
        router = subprocess.Popen([executable, *command, "--worker-urls", *urls, "--port", str(router_port),
                                   "--worker-startup-check-interval", "1", *flags],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(router)
        front = f"http://127.0.0.1:{router_port}"
        wait_ok(front + "/v1/models", procs)
        prompts = [f"{i} a prompt of its own" for i in range(8)]
        expected = {p: complete(served.base_url, p).json()["choices"][0]["text"] for p in prompts}
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: complete(front, p), prompts))
        assert [a.status_code for a in answers] == [200] * 8
        assert [a.json()["choices"][0]["text"] for a in answers] == [expected[p] for p in prompts]
        served_by = [_generated(url) for url in urls]
        assert all(n > 0 for n in served_by), served_by  # the router spread them

        # a drained server finishes what it runs; the router sends the rest to the other
        long = {}
        runner = threading.Thread(target=lambda: long.setdefault("r", complete(urls[0], "a long one", 60)))
        runner.start()
        deadline = time.monotonic() + 20
        while _running(urls[0]) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        workers[0].send_signal(signal.SIGTERM)
        after = [complete(front, f"{i} after the drain").status_code for i in range(6)]
        runner.join(60)
        assert long["r"].status_code == 200 and long["r"].json()["choices"][0]["finish_reason"] == "length"
        assert workers[0].wait(30) == 0
        assert after == [200] * 6, after
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def _generated(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:generation_tokens_total")


def _running(url: str) -> float:
    return httpx.get(url + "/get_load", timeout=10).json()["num_reqs"]
