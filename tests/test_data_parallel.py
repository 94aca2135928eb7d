"""`--data-parallel-size`: N engine processes behind one API server (dspark.server.replicas). The balancer
(fewest outstanding, prefix affinity), the wire (plain data round trips), and tiny replicas served for real:
every request answered with one engine's greedy output, both replicas used, /metrics merged under the
`engine` label, an abort freeing its replica's request, a killed replica failing only its own requests,
a drain finishing what runs while refusing new requests; and the flag's bad values refused by name."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark.request import SpecStats
from dspark.sampling import ReasoningTags, SamplingParams, TokenLogprob
from dspark.server.async_engine import AdmissionError
from dspark.server.balance import BalanceConfig, Balancer
from dspark.server.replicas import core_shares
from dspark.server.streams import RequestDelta
from dspark.server.wire import (delta_from_wire, delta_to_wire, error_from_wire, error_to_wire, params_from_wire,
                                params_to_wire)
from replica_tiny import serve_replicas
from server_harness import CharTokenizer, build_tiny_model, make_engine, serve

PROMPTS = ["the quick brown fox", "hello there", "a b c d e f", "zzz top", "one two three", "jumps over"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def complete(url: str, prompt: str, max_tokens: int = 12, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})


def scrape(url: str) -> dict:
    """{(sample name, engine label): value} and each family's type by name."""
    samples, types = {}, {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=20).text):
        types[family.name] = family.type
        for s in family.samples:
            if not set(s.labels) - {"model_name", "engine"}:
                samples[(s.name, s.labels.get("engine"))] = s.value
    return {"samples": samples, "types": types}


# -- the balancer --------------------------------------------------------------------------------------------
def test_balancer_picks_the_least_loaded_and_skips_replicas_that_take_no_requests():
    b = Balancer(BalanceConfig(block_size=4))
    assert b.pick([1, 2, 3], [3, 1, 2]) == 1
    assert b.pick([9, 9, 9], [0, None, 5]) == 0
    with pytest.raises(LookupError):
        b.pick([1], [None, None])


def test_balancer_keeps_a_prefix_on_its_replica_until_that_one_is_much_busier():
    b = Balancer(BalanceConfig(block_size=4, affinity_slack=2))
    shared = list(range(40, 52))  # three whole blocks
    assert b.pick(shared + [1], [5, 0]) == 1
    assert b.pick(shared + [2, 3], [0, 2]) == 1  # busier by 2: affinity holds
    assert b.pick(shared[:8] + [7, 7, 7, 7], [0, 2]) == 1  # a shorter shared prefix (two blocks) still matches
    assert b.pick(list(range(100, 112)), [0, 2]) == 0  # no shared prefix: the least loaded
    assert b.pick(shared + [4], [0, 3]) == 0  # busier by 3 > slack: the least loaded, which now owns it
    assert b.pick(shared + [5], [1, 0]) == 0


def test_balancer_forgets_the_oldest_prefixes_past_its_bound():
    b = Balancer(BalanceConfig(block_size=1, max_prefixes=4))
    for start in range(10):
        b.pick([start], [0, 0])
    assert len(b._owner) == 4


def test_core_shares_split_the_cpus():
    assert core_shares(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert core_shares(3, [5]) == [[5], [5], [5]]


# -- the wire --------------------------------------------------------------------------------------------------
def test_sampling_params_and_deltas_cross_the_wire_unchanged():
    params = SamplingParams(temperature=0.5, top_k=3, max_tokens=7, stop=("x", "yz"), stop_token_ids=(4,),
                            seed=3, logit_bias={5: -1.5}, bad_words=((6, 7),), allowed_token_ids=(5, 6, 7, 8),
                            logprobs=2, structured_outputs={"json": {"type": "object", "properties": {}}},
                            reasoning_tags=ReasoningTags(start=(10,), end=(11, 12)), n=1)
    assert params_from_wire(params_to_wire(params)) == params
    delta = RequestDelta(request_id="r", text="hi", num_tokens=2, finished=True, finish_reason="stop",
                         num_prompt_tokens=3, num_output_tokens=2, num_cached_tokens=1,
                         spec=SpecStats(2, 6, 3, [2, 1, 0]), logprobs=[TokenLogprob(5, -0.5, [(5, -0.5), (6, -2.0)], 1)],
                         prompt_logprobs=[None, TokenLogprob(7, -1.0, [], 3)])
    assert delta_from_wire(delta_to_wire(delta)) == delta
    with pytest.raises(ValueError, match="unknown sampling parameters"):
        params_from_wire({**params_to_wire(params), "evil": 1})


def test_errors_cross_the_wire_as_the_kinds_the_app_maps():
    refused = error_from_wire(error_to_wire(AdmissionError(429, "full")))
    assert isinstance(refused, AdmissionError) and refused.status_code == 429
    from dspark.request import InvalidRequest
    invalid = error_from_wire(error_to_wire(InvalidRequest("bad stop", "stop")))
    assert isinstance(invalid, InvalidRequest) and invalid.param == "stop"
    assert "KeyError" in str(error_from_wire(error_to_wire(KeyError("x"))))


# -- served replicas ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Each prompt's greedy text from one engine in this process."""
    with serve(make_engine(build_tiny_model())) as served:
        return {p: complete(served.base_url, p).json()["choices"][0]["text"] for p in PROMPTS}


@pytest.fixture(scope="module")
def two_replicas():
    with serve_replicas(2, spec=NGRAM) as served:
        yield served


def test_every_request_is_answered_with_one_engines_greedy_output_by_both_replicas(two_replicas, reference):
    url, replicas = two_replicas
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: complete(url, p).json()["choices"][0]["text"], PROMPTS * 2))
    assert texts == [reference[p] for p in PROMPTS * 2]  # speculation per replica stays lossless
    got = scrape(url)["samples"]
    assert got[("vllm:generation_tokens_total", "0")] > 0 and got[("vllm:generation_tokens_total", "1")] > 0
    assert replicas.num_active == 0


def test_metrics_merge_the_replicas_under_the_engine_label(two_replicas):
    url, _ = two_replicas
    complete(url, "warm up")
    got = scrape(url)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert {got["samples"].get((name, e)) is not None for e in ("0", "1")} == {True}, name
        assert got["types"][name] == "gauge"
    assert got["types"]["vllm:generation_tokens"] == "counter"
    assert got["types"]["vllm:time_to_first_token_seconds"] == "histogram"


def test_a_repeated_prefix_goes_to_the_replica_that_has_it(two_replicas):
    url, _ = two_replicas
    prompt = "a long shared system prompt that spans several blocks: "
    before = scrape(url)["samples"]
    for tail in ("first", "second", "third"):
        assert complete(url, prompt + tail, max_tokens=2).status_code == 200
    after = scrape(url)["samples"]
    hits = {e: after.get(("vllm:prefix_cache_hits_total", e), 0) - before.get(("vllm:prefix_cache_hits_total", e), 0)
            for e in ("0", "1")}
    assert sorted(hits.values())[0] == 0 and sorted(hits.values())[1] >= 2 * len(prompt) // 4 - 2, hits


def test_a_stream_closed_early_frees_its_replicas_request(two_replicas):
    url, replicas = two_replicas
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "stream me", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while replicas.num_active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replicas.num_active == 0
    samples = scrape(url)["samples"]
    assert all(samples[("vllm:num_requests_running", e)] == 0 for e in ("0", "1"))


def test_a_killed_replica_fails_only_its_own_requests():
    with serve_replicas(2, step_sleep_s=0.05) as (url, replicas):
        results: dict[int, httpx.Response] = {}

        def run(i: int) -> None:
            results[i] = complete(url, f"{i} distinct prompt", max_tokens=60)  # no shared prefix

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(1 for r in replicas.replicas if r.streams) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        victim = replicas.replicas[1]
        doomed = set(victim.streams)
        assert doomed and replicas.replicas[0].streams
        os.kill(victim.proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        failed = [i for i, r in results.items() if r.status_code != 200]
        assert len(results) == 4 and 0 < len(failed) < 4, {i: r.status_code for i, r in results.items()}
        assert all(results[i].status_code == 500 and "replica 1" in results[i].text for i in failed)
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert [r["state"] for r in health.json()["replicas"]] == ["ready", "dead"]
        assert complete(url, "still served", max_tokens=4).status_code == 200  # by replica 0
        deadline = time.monotonic() + 20  # the last stream's end reaches the set just after its response
        while replicas.num_active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replicas.error is None and replicas.num_active == 0


def test_a_drain_finishes_what_runs_and_refuses_new_requests():
    with serve_replicas(2, step_sleep_s=0.05) as (url, replicas):
        result = {}
        runner = threading.Thread(target=lambda: result.setdefault("r", complete(url, "long one", max_tokens=40)))
        runner.start()
        deadline = time.monotonic() + 30
        while not replicas.num_active and time.monotonic() < deadline:
            time.sleep(0.02)
        replicas.begin_drain(timeout_s=60)
        refused = complete(url, "too late")
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        rejected = {s.labels["engine"]: s.value for family in text_string_to_metric_families(
            httpx.get(url + "/metrics", timeout=20).text) for s in family.samples
            if s.name == "vllm:num_requests_rejected_total" and s.labels.get("status") == "503"}
        assert rejected.get("api") == 1.0, rejected  # refused by this process, before any replica saw it
        runner.join(60)
        assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["finish_reason"] == "length"
        done = threading.Thread(target=replicas.run_forever)
        done.start()
        done.join(30)
        assert not done.is_alive() and replicas.error is None  # every replica drained and exited
        assert [r.proc.returncode for r in replicas.replicas] == [0, 0]


def test_a_replica_that_cannot_build_its_engine_fails_the_launch_naming_it():
    from dspark.server.replicas import ReplicaLaunch, ReplicaSet
    from replica_tiny import launch_env
    bad = ReplicaSet(ReplicaLaunch("replica_tiny:no_such_factory", env=launch_env()), 1, tokenizer=CharTokenizer(),
                     threads=1, pin_cores=False)
    with pytest.raises(RuntimeError, match="replica 0 failed to start: AttributeError"):
        bad.launch()


# -- the flag -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["-dp", "2", "--device", "cuda"], "--data-parallel-size 2 runs CPU replicas"),
    (["-dp", "2", "-tp", "2", "--nnodes", "2"], "--data-parallel-size 2 with --nnodes 2"),
    (["--nnodes", "0"], "--nnodes must be >= 1"),
])
def test_bad_data_parallel_flags_are_refused_naming_the_flag(argv, message):
    proc = subprocess.run([sys.executable, "-m", "dspark", "serve", "--speculative-config", "none", *argv],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(
                              Path(__file__).resolve().parents[1])})
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Loading" not in proc.stderr


def test_replica_set_interface_matches_what_the_app_reads():
    """The attributes `build_app` and `serve_app` use on an `AsyncEngine` exist on a `ReplicaSet`."""
    from dspark.server.async_engine import AsyncEngine
    from dspark.server.replicas import ReplicaSet
    used = ["tokenizer", "engine_config", "has_local_engine", "check_admission", "check_request", "add_requests",
            "abort", "is_healthy", "error", "health_report", "max_model_len", "start", "shutdown", "draining",
            "begin_drain", "run_forever", "max_num_waiting", "request_timeout_s", "stats", "metrics", "num_active"]
    engine = AsyncEngine(make_engine(build_tiny_model()), CharTokenizer())
    replicas = ReplicaSet(None, 2, tokenizer=CharTokenizer())  # not launched: its attributes only
    for obj in (engine, replicas):
        assert [n for n in used if not (hasattr(type(obj), n) or n in vars(obj))] == [], type(obj).__name__
    assert asyncio.iscoroutinefunction(ReplicaSet.add_requests)
