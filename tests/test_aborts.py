"""Aborts at every stage free everything the request held: KV blocks (and their hash-chain state),
the drafter's per-request state (the lookup wrapper's pending proposals), and the engine's and the
scheduler's books; the other requests' greedy output is unchanged.

Engine level (each stage reached exactly): waiting, between prefill chunks, with drafts proposed and
not yet verified (inside a verification window), and after finishing. Served: a stream closed while
its request waits, one closed mid-prefill, a speculative stream closed mid-way, and a non-streaming
client that times out; after each, /metrics shows running, waiting and KV usage at 0. And a soak
whose per-request usage sums equal the Prometheus counters exactly.
"""

from __future__ import annotations

import json
import threading
import time

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter
from dspark.drafters.dspark import save_dspark
from dspark.engine.engine import Engine
from dspark.sampling import SamplingParams
from server_harness import MODEL, build_tiny_model, make_engine, serve, slowed
from tests.dspark_helpers import TARGET, random_model, random_target, tiny_cfg

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LONG = list(range(3, 43))  # 40 tokens: two prefill chunks at a budget of 24
OTHERS = [[1, 17, 33, 60, 5, 9, 88, 21, 40], [1, 5, 5, 5, 5, 5]]


@pytest.fixture(scope="module")
def target():
    return random_target(seed=7)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    cfg = tiny_cfg(enable_confidence_head=True)
    path = tmp_path_factory.mktemp("aborts") / "d"
    save_dspark(random_model(cfg, seed=3), cfg, path, dtype="float32")
    return SpecConfig(method="dspark", model=str(path), num_speculative_tokens=4,
                      ngram_first=True, prompt_lookup_min=1)


def build(target, spec=None, max_num_seqs=16) -> Engine:
    config = EngineConfig(spec=spec, cache=CacheConfig(kv_block_size=4, num_kv_blocks=96),
                          scheduler=SchedulerConfig(max_num_batched_tokens=24,
                                                    max_num_seqs=max_num_seqs))
    drafter = None if spec is None else build_drafter(spec, target_config=TARGET,
                                                      target_model=target, dtype=torch.float32,
                                                      device="cpu")
    return Engine(config, model=target, model_config=TARGET, drafter=drafter)


def drain(engine: Engine, out: dict[str, list[int]]) -> None:
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)


def assert_clean(engine: Engine, aborted: str) -> None:
    bm = engine.block_manager
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    assert bm.num_free_blocks == len(bm.blocks) and engine.stats().kv_usage == 0.0
    assert aborted not in bm.hash_state, "hash-chain bookkeeping of the aborted request"
    bm.check_invariants()
    pending = getattr(engine.drafter, "_pending", None)
    assert not pending, f"lookup bookkeeping left: {pending}"


@pytest.fixture(scope="module")
def plain_others(target):
    engine = build(target)
    ids = [engine.add_request(p, GREEDY) for p in OTHERS]
    out: dict = {}
    drain(engine, out)
    return [out[i] for i in ids]


def _until(engine: Engine, done, limit: int = 50) -> dict:
    out: dict = {}
    for _ in range(limit):
        if done():
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("stage never reached")


STAGES = {  # (request, the drafts the scheduler holds for it)
    "waiting": lambda r, d: r.status.value == "waiting" and r.num_computed_tokens == 0,
    "prefill_chunk": lambda r, d: 0 < r.num_computed_tokens < len(r.prompt_ids),
    "verify_window": lambda r, d: d is not None and d.verify_len > 0 and bool(d.ids),
}


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("stage", list(STAGES))
def test_abort_at_each_stage_frees_everything(target, spec, plain_others, stage, speculative):
    if stage == "verify_window" and not speculative:
        pytest.skip("no drafts without a drafter")
    engine = build(target, spec if speculative else None, max_num_seqs=2)
    others = [engine.add_request(p, GREEDY) for p in OTHERS]
    # waiting: max_num_seqs=2 keeps the victim out; else it is admitted and prefilled in chunks
    victim = engine.add_request(LONG if stage != "verify_window" else [1, 4, 4, 4, 4, 4, 4],
                                GREEDY)
    req = engine.requests[victim]
    out = _until(engine, lambda: STAGES[stage](req, engine.scheduler.drafts.get(victim)), limit=80)
    final = engine.abort(victim)  # released at once; no step reports it
    assert final.finished and final.finish_reason == "abort" and final.new_token_ids == []
    assert victim not in engine.requests and not req.block_table and req.state_slot is None
    assert victim not in engine.scheduler.drafts  # its held drafts go with it
    drain(engine, out)
    assert [out.get(i, []) for i in others] == plain_others
    assert len(out.get(victim, [])) < GREEDY.max_tokens
    assert_clean(engine, victim)


def test_abort_after_finish_is_a_no_op(target, spec):
    engine = build(target, spec)
    rid = engine.add_request(OTHERS[0], GREEDY)
    drain(engine, {})
    assert engine.abort(rid) is None
    assert not engine.has_unfinished() and engine.step() == []
    assert_clean(engine, rid)


# -- served ----------------------------------------------------------------------------------------
def assert_metrics_zero(srv) -> None:
    srv.wait_idle()
    m = srv.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert m[(f"vllm:{name}", ())] == 0, name


def _open_and_close(srv, payload: dict, close_after_s: float, until=None) -> None:
    """Open a stream, wait for its role chunk, read on until `until()` holds (if given), then close it."""
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=payload,
                      timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(lines)  # the role chunk: the request is in the engine
        if until is not None:
            deadline = time.monotonic() + 20
            for _ in lines:
                if until() or time.monotonic() > deadline:
                    break
        time.sleep(close_after_s)


def test_served_aborts_while_waiting_and_mid_prefill():
    engine = slowed(make_engine(build_tiny_model(), max_num_seqs=1, budget=16), 0.05)
    with serve(engine) as srv:
        busy = threading.Thread(target=lambda: srv.post("/v1/completions", json={
            "model": MODEL, "prompt": "hold the slot", "max_tokens": 30, "ignore_eos": True}))
        busy.start()
        time.sleep(0.3)
        before = engine.metrics.num_prompt_tokens
        _open_and_close(srv, {"model": MODEL, "stream": True, "max_tokens": 5, "messages": [
            {"role": "user", "content": "waiting"}]}, 0.1)
        busy.join()
        assert_metrics_zero(srv)
        assert engine.metrics.num_prompt_tokens - before < 30, "the waiting one never prefilled"
        before = engine.metrics.num_prompt_tokens
        gen = engine.metrics.num_generation_tokens
        _open_and_close(srv, {"model": MODEL, "stream": True, "max_tokens": 5, "messages": [
            {"role": "user", "content": "p" * 100}]}, 0.2)  # ~110 tokens, 16 a step
        assert_metrics_zero(srv)
        assert 0 < engine.metrics.num_prompt_tokens - before < 100, "aborted between chunks"
        assert engine.metrics.num_generation_tokens == gen
        abort = ("vllm:request_success_total", (("finished_reason", "abort"),))
        assert srv.metrics()[abort] == 2


def test_served_speculative_stream_and_timeout_aborts():
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                      prompt_lookup_max=3)
    engine = slowed(make_engine(build_tiny_model(), spec=spec), 0.02)
    with serve(engine) as srv:
        _open_and_close(srv, {"model": MODEL, "stream": True, "max_tokens": 80, "temperature": 0.0,
                              "ignore_eos": True, "messages": [
                                  {"role": "user", "content": "ab ab ab ab ab"}]}, 0.05,
                        until=lambda: engine.metrics.num_drafts > 0)  # a loaded machine drafts late
        assert_metrics_zero(srv)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.base_url + "/v1/completions", timeout=0.3, json={
                "model": MODEL, "prompt": "ab ab ab", "max_tokens": 100, "ignore_eos": True, "temperature": 0.0})
        assert_metrics_zero(srv)
        assert engine.metrics.num_generation_tokens < 200
        assert engine.metrics.num_drafts > 0, "the stream was speculative"


# -- accounting ------------------------------------------------------------------------------------
def test_usage_and_counters_agree_exactly_after_a_soak():
    """24 requests, 8 at a time, streamed and not, speculative (prompt lookup): the sums of the
    per-request usage equal the Prometheus counters (prompt tokens computed = prompt - cached)."""
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                      prompt_lookup_max=3)
    with serve(make_engine(build_tiny_model(), spec=spec)) as srv:
        before = srv.metrics()

        def one(i: int) -> dict:
            body = {"model": MODEL, "prompt": f"ab ab {i % 5} ab ab", "max_tokens": 5 + i % 13,
                    "temperature": 0 if i % 3 else 0.7, "seed": i, "ignore_eos": i % 2 == 0}
            if i % 2:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                with httpx.stream("POST", srv.base_url + "/v1/completions", json=body,
                                  timeout=60) as r:
                    chunks = [json.loads(line[6:]) for line in r.iter_lines()
                              if line.startswith("data: {")]
                return chunks[-1]["usage"]
            return srv.post("/v1/completions", json=body).json()["usage"]

        with ThreadPoolExecutor(8) as pool:
            usages = list(pool.map(one, range(24)))
        srv.wait_idle()
        after = srv.metrics()

    def delta(name: str) -> float:
        key = (f"vllm:{name}", ())
        return after[key] - before.get(key, 0)

    assert delta("generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("prompt_tokens_total") == sum(
        u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert delta(f"spec_decode_{name}_total") == sum(u["spec"][name] for u in usages), name
    assert delta("spec_decode_num_drafts_total") > 0


def test_non_stream_client_leaving_while_waiting_frees_its_place():
    """No delta arrives while a request waits, so the disconnect is watched on its own: the place
    is freed while the request ahead still runs, and its prompt is never computed."""
    engine = slowed(make_engine(build_tiny_model(), max_num_seqs=1), 0.05)
    with serve(engine) as srv:
        busy = threading.Thread(target=lambda: srv.post("/v1/completions", json={
            "model": MODEL, "prompt": "hold the slot", "max_tokens": 60, "ignore_eos": True}))
        busy.start()
        time.sleep(0.3)
        before = engine.metrics.num_prompt_tokens
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.base_url + "/v1/completions", timeout=0.3, json={
                "model": MODEL, "prompt": "left while waiting", "max_tokens": 5})
        deadline = time.monotonic() + 5
        while srv.engine.stats().num_waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.engine.stats().num_waiting == 0 and busy.is_alive(), "freed while the other runs"
        busy.join()
        assert engine.metrics.num_prompt_tokens == before, "the waiting prompt was never computed"
        assert_metrics_zero(srv)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_all_abort_when_the_client_leaves(stream):
    """n=3: the client leaving aborts every choice's engine request."""
    engine = slowed(make_engine(build_tiny_model()), 0.03)
    with serve(engine) as srv:
        body = {"model": MODEL, "prompt": "n choices", "max_tokens": 60, "n": 3,
                "temperature": 0.8, "ignore_eos": True, "stream": stream}
        if stream:
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body,
                              timeout=30) as resp:
                assert resp.status_code == 200
                next(resp.iter_lines())
        else:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(srv.base_url + "/v1/completions", timeout=0.4, json=body)
        assert_metrics_zero(srv)
        assert engine.metrics.num_generation_tokens < 3 * 60
        abort = ("vllm:request_success_total", (("finished_reason", "abort"),))
        assert srv.metrics()[abort] == 3


@pytest.mark.parametrize("n", [1, 2])
def test_a_batch_whose_client_left_is_aborted_whole(n):
    """A 128-prompt completions batch goes into the engine in one turn of its loop (with n = 2, every prompt's
    first choice; the second once the first has emitted), so the client leaving while its first prompts run
    aborts every one of them, admitted or waiting: none is left to run."""
    engine = slowed(make_engine(build_tiny_model(), max_num_seqs=2), 0.05)
    with serve(engine) as srv:
        body = {"model": MODEL, "prompt": [f"prompt {i}" for i in range(128)], "max_tokens": 60, "ignore_eos": True,
                "n": n, "temperature": 0.5}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.base_url + "/v1/completions", timeout=0.5, json=body)
        deadline = time.monotonic() + 10
        while engine.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.requests, f"{len(engine.requests)} requests of the batch left"
        # the first two prompts (max_num_seqs) were still running when the client left: no other ever started
        assert engine.metrics.num_prompt_tokens == 2 * len("prompt 0")
        assert_metrics_zero(srv)


def test_one_clients_batch_does_not_hold_back_another_clients_request():
    """Admission takes turns by client: a probe sent while a 32-prompt batch waits is admitted after the batch's
    current turn, so it is answered while most of the batch still waits."""
    engine = slowed(make_engine(build_tiny_model(), max_num_seqs=2), 0.02)
    with serve(engine) as srv:
        body = {"model": MODEL, "prompt": [f"prompt {i}" for i in range(32)], "max_tokens": 12, "ignore_eos": True}
        batch = threading.Thread(target=lambda: srv.post("/v1/completions", json=body))
        batch.start()
        deadline = time.monotonic() + 10
        while srv.engine.stats().num_waiting < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        probe = srv.post("/v1/completions", json={"model": MODEL, "prompt": "probe", "max_tokens": 4})
        assert probe.status_code == 200
        assert srv.engine.stats().num_waiting >= 16 and batch.is_alive(), "the probe waited for the batch"
        batch.join()
        assert_metrics_zero(srv)
