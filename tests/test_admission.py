"""Admission and shutdown: a bounded waiting queue (429 + Retry-After past it, every admitted request
completes), the per-request deadline (504, blocks freed), and SIGTERM on a real `serve_app` process
(drains: 503 to newcomers, running requests finish or are aborted at the drain timeout, exit 0; a
dead engine loop exits 1).
"""

from __future__ import annotations

import json
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

from dspark.server.config import ServerConfig, resolve_api_key
from server_harness import MODEL, build_tiny_model, make_engine, serve, slowed

NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model()


def test_waiting_queue_bound_gives_429_and_the_admitted_complete(tiny_model):
    engine = slowed(make_engine(tiny_model), 0.03)
    with serve(engine, config=ServerConfig(max_num_waiting=2, retry_after_s=3)) as srv:
        def one(i):
            return srv.post("/v1/completions", json={
                "model": MODEL, "prompt": f"p{i}", "max_tokens": 6, **NO_EOS})

        with ThreadPoolExecutor(30) as pool:
            responses = list(pool.map(one, range(30)))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        refused = [r for r in responses if r.status_code == 429]
        assert refused, "30 at once against 8 running + 2 waiting must overflow"
        assert all(r.headers["retry-after"] == "3" for r in refused)
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in refused)
        served = [r for r in responses if r.status_code == 200]
        assert len(served) >= 2 and all(r.json()["usage"]["completion_tokens"] == 6
                                         for r in served)
        srv.wait_idle()
        m = srv.metrics()
        assert m[("vllm:num_requests_rejected_total", (("status", "429"),))] == len(refused)
        assert srv.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                 "max_tokens": 2}).status_code == 200


def test_deadline_aborts_with_504_and_frees_blocks(tiny_model):
    engine = slowed(make_engine(tiny_model), 0.02)
    with serve(engine, config=ServerConfig(request_timeout_s=0.3)) as srv:
        resp = srv.post("/v1/completions", json={"model": MODEL, "prompt": "late",
                                                 "max_tokens": 100, **NO_EOS})
        assert resp.status_code == 504, resp.text
        assert "deadline of 0.3 s" in resp.json()["error"]["message"]
        with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "late", "max_tokens": 100, "stream": True,
                **NO_EOS}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 504
        srv.wait_idle()
        assert engine.metrics.num_generation_tokens < 200
        ok = srv.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


def test_api_key_from_the_environment():
    assert resolve_api_key("flag", {"DSPARK_API_KEY": "a"}) == "flag"
    assert resolve_api_key(None, {"DSPARK_API_KEY": "a", "VLLM_API_KEY": "b"}) == "a"
    assert resolve_api_key(None, {"VLLM_API_KEY": "b"}) == "b"
    assert resolve_api_key(None, {}) is None
    with pytest.raises(ValueError, match="max_num_waiting"):
        ServerConfig(max_num_waiting=0)


def test_api_key_guards_every_data_route_and_optionally_metrics(tiny_model):
    config = ServerConfig(api_key="k3y", api_key_metrics=True)
    with serve(make_engine(tiny_model, num_kv_blocks=32), config=config) as srv:
        get = lambda path, **kw: httpx.get(srv.base_url + path, timeout=10, **kw)  # noqa: E731
        assert get("/health").status_code == 200, "health needs no key"
        for path in ("/metrics", "/v1/models", "/tokenize", "/anything"):
            resp = get(path)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == 401, path
        for header in ("Bearer wrong", "Basic k3y", "k3y", "Bearer k3y2", "Bearer"):
            assert get("/v1/models", headers={"authorization": header}).status_code == 401, header
        good = {"authorization": "Bearer k3y"}
        assert get("/metrics", headers=good).status_code == 200
        assert get("/v1/models", headers=good).status_code == 200
    with serve(make_engine(tiny_model, num_kv_blocks=32), config=ServerConfig(api_key="k")) as srv:
        assert httpx.get(srv.base_url + "/metrics", timeout=10).status_code == 200, "optional"


# -- SIGTERM on a real process -------------------------------------------------------------------
SERVE_TINY = Path(__file__).parent / "serve_tiny.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*flags: str):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(SERVE_TINY), str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120  # a hang guard: import + tiny model build
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("serve_tiny did not come up")


def _stream(base: str, max_tokens: int, out: list) -> None:
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "drain", "max_tokens": max_tokens, "stream": True,
            **NO_EOS}) as r:
        out.extend(json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                   for line in r.iter_lines() if line.startswith("data: "))


def _first_event(events: list, stream: threading.Thread) -> None:
    """Wait for the stream's first event; a hang guard (a stream that died or never starts fails the test)."""
    deadline = time.monotonic() + 120
    while not events:
        assert stream.is_alive() and time.monotonic() < deadline, "the stream ended or stalled before its first event"
        time.sleep(0.01)


def _sigterm_while_streaming(base: str, proc, max_tokens: int) -> tuple[list, httpx.Response]:
    events: list = []
    t = threading.Thread(target=_stream, args=(base, max_tokens, events))
    t.start()
    _first_event(events, t)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    try:
        late = httpx.post(base + "/v1/completions", timeout=10,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    except httpx.TransportError:  # the drain finished first
        late = None
    t.join(60)
    return events, late


def test_sigterm_drains_running_requests_then_exits_0():
    proc, base = _start("--step-sleep-s", "0.02", "--drain-timeout-s", "30")
    try:
        events, late = _sigterm_while_streaming(base, proc, 60)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length", "the running request finished"
    assert sum(e["choices"][0]["num_tokens"] for e in events[:-1] if e["choices"]) == 60
    assert late is not None and late.status_code == 503 and "retry-after" in late.headers


def test_sigterm_aborts_what_outlives_the_drain_timeout():
    proc, base = _start("--step-sleep-s", "0.05", "--drain-timeout-s", "0.5")
    try:
        events, _ = _sigterm_while_streaming(base, proc, 120)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    finished = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finished and finished[-1]["choices"][0]["finish_reason"] == "abort"


def test_engine_loop_death_exits_nonzero():
    proc, base = _start("--fail-at-step", "3")
    try:
        resp = httpx.post(base + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 20, **NO_EOS})
        assert resp.status_code == 500 and "planted engine fault" in resp.text
        assert proc.wait(60) == 1
    finally:
        proc.kill()


def test_connection_limit_refuses_before_reading_a_body():
    proc, base = _start("--step-sleep-s", "0.05", "--max-connections", "2")
    try:
        events: list = []
        t = threading.Thread(target=_stream, args=(base, 30, events))
        t.start()
        _first_event(events, t)
        resp = httpx.post(base + "/v1/completions", timeout=10, json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 503
        t.join(60)
        assert events[-1] == "[DONE]"
        ok = httpx.post(base + "/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
