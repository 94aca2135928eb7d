"""The OpenAI-compatible server end to end: a real tiny random-weight Llama engine behind uvicorn on
127.0.0.1, driven by the official `openai` client and by raw HTTP.

Checks: schema (models, completions, chat, stream and not), SSE order and [DONE], usage and the
dspark extensions, stop strings that never leak, every bad input → the right 4xx with a following
good request still served, client disconnect → all KV blocks free, /metrics parses and moves, the
API key, and 8 concurrent streams == one-at-a-time greedy.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dspark.config import SpecConfig
from dspark.sampling import SamplingParams
from dspark.server.async_engine import AsyncEngine
from server_harness import (MAX_MODEL_LEN, MODEL, CharTokenizer, Served, build_tiny_model,
                            make_engine, serve, stream_events)


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model()


@pytest.fixture(scope="module")
def plain(tiny_model):
    with serve(make_engine(tiny_model)) as srv:
        yield srv


@pytest.fixture(scope="module")
def spec_server(tiny_model):
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                      prompt_lookup_max=3)
    with serve(make_engine(tiny_model, spec=spec)) as srv:
        yield srv


GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}
USER_X = [{"role": "user", "content": "x"}]


# -- the official client -------------------------------------------------------------------------
def test_models_list(plain):
    models = plain.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_non_stream_usage(plain):
    prompt = "Hello, world"
    out = plain.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                            temperature=0, extra_body=NO_EOS)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.object == "text_completion" and out.id
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == len(prompt) + 12
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    spec = out.usage.model_extra["spec"]
    assert set(spec) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                         "acceptance_length"}
    assert len(choice.text) <= 12
    by_ids = plain.client().completions.create(model=MODEL, prompt=CharTokenizer().encode(prompt),
                                               max_tokens=12, temperature=0, extra_body=NO_EOS)
    assert by_ids.choices[0].text == choice.text, "a token-id prompt equals its text"


def test_completion_stream_matches_non_stream(plain):
    client = plain.client()
    kwargs = dict(model=MODEL, prompt="abc abc abc", max_tokens=20, temperature=0,
                  extra_body=NO_EOS)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    assert sum(c.choices[0].model_extra["num_tokens"] for c in text_chunks) == 20


def test_chat_stream_and_non_stream(plain):
    client = plain.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           temperature=0, extra_body=NO_EOS)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    prompt_len = len(CharTokenizer().apply_chat_template(messages))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_len, 10)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == prompt_len + 10 and not chunks[-1].choices


def test_sse_order_and_done(plain):
    events = stream_events(plain, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
        "stream": True, "stream_options": {"include_usage": True}, **GREEDY, **NO_EOS})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    finish = [i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == [len(chunks) - 2], "one finishing chunk, just before the usage chunk"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" not in c for c in chunks[:-1])
    # without include_usage: no usage chunk, still [DONE]
    events = stream_events(plain, "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True, **GREEDY, **NO_EOS})
    assert events[-1] == "[DONE]" and all(json.loads(e)["choices"] for e in events[:-1])


# -- stop strings --------------------------------------------------------------------------------
def _pick_stop(text: str) -> str:
    for start in range(4, len(text) - 3):
        stop = text[start:start + 3]
        if stop.strip() and text.find(stop) >= 2:
            return stop
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_strings_never_leak(plain):
    client = plain.client()
    kwargs = dict(model=MODEL, prompt="The sea", temperature=0, max_tokens=40, extra_body=NO_EOS)
    full = client.completions.create(**kwargs).choices[0].text
    stop = _pick_stop(full)
    cut = full[:full.find(stop)]
    out = client.completions.create(stop=[stop, "\x7f\x7f"], **kwargs).choices[0]
    assert (out.text, out.finish_reason) == (cut, "stop")
    streamed = list(client.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"
    kwargs["extra_body"] = {**NO_EOS, "include_stop_str_in_output": True}
    assert client.completions.create(stop=stop, **kwargs).choices[0].text == cut + stop
    plain.wait_idle()


def test_stop_token_ids(plain):
    client = plain.client()
    kwargs = dict(model=MODEL, prompt="zz", temperature=0, max_tokens=30)
    full = client.completions.create(extra_body=NO_EOS, **kwargs).choices[0].text
    token = CharTokenizer().encode(full[5])[0]
    out = client.completions.create(extra_body={**NO_EOS, "stop_token_ids": [token]}, **kwargs)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(full[5]) + 1]


# -- bad input -----------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"model": MODEL, "prompt": list(range(3, 3 + MAX_MODEL_LEN))}, 400, "maximum model length"),
    ({"model": MODEL, "prompt": "y" * (MAX_MODEL_LEN + 5)}, 400, "maximum model length"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "greater than or equal to 1"),
    ({"model": MODEL, "prompt": ["a"] * 257}, 400, "at most 256 prompts"),
    ({"model": MODEL, "prompt": [[5, 6], [5, 10_000]]}, 400, "vocabulary"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": [5, 10_000]}, 400, "vocabulary"),
    ({"model": MODEL, "prompt": []}, 400, "empty"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": "gpt-17", "prompt": "x"}, 404, "gpt-17"),
]


@pytest.mark.parametrize("payload,status,needle", BAD_COMPLETIONS,
                         ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_bad_completion_input_is_4xx_and_server_keeps_serving(plain, payload, status, needle):
    resp = plain.post("/v1/completions", json=payload)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"], error
    ok = plain.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_bad_chat_and_protocol_input(plain):
    cases = [
        (plain.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                    headers={"content-type": "application/json"}), 400, "malformed JSON"),
        (plain.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400,
         "messages"),
        (plain.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "wizard", "content": "x"}]}), 400, "wizard"),
        (plain.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "image_url"}]}]}), 400, "image_url"),
        (plain.post("/v1/nothing", json={}), 404, "Not Found"),
    ]
    for resp, status, needle in cases:
        assert resp.status_code == status, resp.text
        assert needle in resp.json()["error"]["message"], resp.text
    assert cases[1][0].json()["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        plain.client().chat.completions.create(model="nope", messages=USER_X)
    with pytest.raises(openai.BadRequestError):
        plain.client().chat.completions.create(model=MODEL, messages=USER_X,
                                               temperature=-3)
    ok = plain.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "parts"}]}], max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    plain.wait_idle()


# -- abort ---------------------------------------------------------------------------------------
def test_client_disconnect_aborts_and_frees_kv(plain):
    before = plain.metrics()
    payload = {"model": MODEL, "prompt": "abort me", "max_tokens": 100, "stream": True, **NO_EOS}
    with httpx.stream("POST", plain.base_url + "/v1/completions", json=payload, timeout=60) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break  # leaving the block closes the connection mid-stream
    plain.wait_idle()
    after = plain.metrics()
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    assert after[key] == before.get(key, 0) + 1
    gen = ("vllm:generation_tokens_total", ())
    assert after[gen] < before[gen] + 100, "the request stopped early"


# -- metrics -------------------------------------------------------------------------------------
def test_metrics_parse_and_move(plain):
    before = plain.metrics()
    out = plain.client().completions.create(model=MODEL, prompt="count me", max_tokens=5,
                                            temperature=0, extra_body=NO_EOS)
    plain.wait_idle()
    after = plain.metrics()
    length = ("vllm:request_success_total", (("finished_reason", "length"),))
    assert after[length] == before.get(length, 0) + 1
    gen = ("vllm:generation_tokens_total", ())
    assert after[gen] == before[gen] + out.usage.completion_tokens
    assert after[("vllm:prompt_tokens_total", ())] > before[("vllm:prompt_tokens_total", ())]
    for name in ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens"):
        key = (f"vllm:{name}_count", ())
        assert after[key] == before[key] + 1, name
    itl = ("vllm:inter_token_latency_seconds_count", ())  # one gap per pair of steps with output
    assert after[itl] == before[itl] + out.usage.completion_tokens - 1
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert (f"vllm:{name}", ()) in after, name
    queries = ("vllm:prefix_cache_queries_total", ())
    assert after[queries] == before[queries] + out.usage.prompt_tokens
    for name in ("kv_cache_usage_perc", "num_requests_waiting", "num_requests_running",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_wasted_verify_tokens_total",
                 "spec_decode_verify_budget_count"):
        assert (f"vllm:{name}", ()) in after, name
    assert after[("vllm:num_requests_running", ())] == 0


def test_speculative_usage_and_counters(spec_server):
    before = spec_server.metrics()
    chunks = list(spec_server.client().completions.create(
        model=MODEL, prompt="ab ab ab ab ab ab", max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    spec_server.wait_idle()
    usage = chunks[-1].usage
    spec = usage.model_extra["spec"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    tau = 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
    assert spec["acceptance_length"] == pytest.approx(tau)
    per_chunk = [c.choices[0].model_extra["num_tokens"] for c in chunks if c.choices]
    assert sum(per_chunk) == usage.completion_tokens == 40
    after = spec_server.metrics()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        key = (f"vllm:spec_decode_{name}_total", ())
        assert after[key] - before.get(key, 0) == spec[name], name
    wasted = ("vllm:spec_decode_num_wasted_verify_tokens_total", ())
    num_rejected = spec["num_draft_tokens"] - spec["num_accepted_tokens"]
    assert after[wasted] - before.get(wasted, 0) == num_rejected
    budget = ("vllm:spec_decode_verify_budget_count", ())
    assert after[budget] > before.get(budget, 0)
    assert spec["num_accepted_tokens"] > 0 and max(per_chunk) > 1, "the looping text is predictable"
    assert after[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] > 0
    # per-request opt-out: no drafts for this request
    out = spec_server.client().completions.create(model=MODEL, prompt="ab ab ab ab", max_tokens=10,
                                                  temperature=0,
                                                  extra_body={**NO_EOS, "speculation": False})
    assert out.usage.model_extra["spec"]["num_drafts"] == 0


# -- API key -------------------------------------------------------------------------------------
def test_api_key(tiny_model):
    with serve(make_engine(tiny_model, num_kv_blocks=32), api_key="s3cret") as srv:
        with pytest.raises(openai.AuthenticationError):
            srv.client("wrong").models.list()
        resp = srv.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        bad_json = srv.post("/v1/completions", content=b"{",
                            headers={"content-type": "application/json"})
        assert bad_json.status_code == 401, "the key is checked before the body is parsed"
        assert httpx.get(srv.base_url + "/health").json() == {"status": "ok"}, "no key needed"
        out = srv.client("s3cret").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert out.usage.completion_tokens >= 1


# -- batching ------------------------------------------------------------------------------------
PROMPTS = [f"prompt {i}: " + "lorem ipsum "[: 3 + i] for i in range(8)]


def _stream_text(srv: Served, prompt: str) -> tuple[str, int]:
    chunks = list(srv.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("which", ["plain", "spec_server"])
def test_concurrent_streams_match_sequential_greedy(which, request):
    srv: Served = request.getfixturevalue(which)
    steps_before = srv.engine.metrics.num_steps
    sequential = [_stream_text(srv, p) for p in PROMPTS]
    steps_between = srv.engine.metrics.num_steps
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(lambda p: _stream_text(srv, p), PROMPTS))
    assert concurrent == sequential
    num_sequential_steps = steps_between - steps_before
    num_concurrent_steps = srv.engine.metrics.num_steps - steps_between
    assert num_concurrent_steps < num_sequential_steps, "concurrent requests must share steps"
    assert all(n == 16 for _, n in sequential)
    srv.wait_idle()



def test_serve_cli_flags():
    import argparse

    from dspark.server.cli import configs_from_args, default_spec, register, run
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "some/model", "--port", "8123", "--api-key", "k",
                              "--served-model-name", "m", "--speculative-config", "none"])
    config, server = configs_from_args(args)
    assert (config.model, server.host, server.port, server.api_key, server.served_model_name) == (
        "some/model", "127.0.0.1", 8123, ("k",), ("m",))
    assert config.spec is None
    assert args.func is run and server.uvicorn_log_level == "info"
    assert parser.parse_args(["serve"]).port == 8000
    config, _ = configs_from_args(parser.parse_args(["serve", "no-such-model"]))
    assert default_spec(config) is None and config.spec is None


def test_prefix_cache_hit_is_reported(plain):
    client = plain.client()
    prompt = "a shared prefix of some length"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= len(prompt) - 4, "kv_block_size 4"


def test_engine_failure_fails_requests_and_health(tiny_model):
    engine = make_engine(tiny_model, num_kv_blocks=32)
    real_step = engine.step

    def failing_step():
        if engine.metrics.num_steps >= 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = failing_step
    with serve(engine) as srv:
        events = stream_events(srv, "/v1/completions", {
            "model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True, **NO_EOS})
        assert events[-1] == "[DONE]" and "device lost" in json.loads(events[-2])["error"]["message"]
        assert httpx.get(srv.base_url + "/health").status_code == 503
        resp = srv.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 503 and "device lost" in resp.json()["error"]["message"]


def test_non_stream_disconnect_aborts(tiny_model):
    engine = make_engine(tiny_model, num_kv_blocks=32)
    real_step = engine.step

    def slow_step():  # 100 tokens take >= 5 s; the client gives up after 0.5 s
        time.sleep(0.05)
        return real_step()

    engine.step = slow_step
    with serve(engine) as srv:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.base_url + "/v1/completions", timeout=0.5, json={
                "model": MODEL, "prompt": "slow", "max_tokens": 100, **NO_EOS})
        start_s = time.monotonic()
        srv.wait_idle(timeout_s=4.0)
        assert time.monotonic() - start_s < 4.0
        assert engine.metrics.num_generation_tokens < 100
        abort = ("vllm:request_success_total", (("finished_reason", "abort"),))
        assert srv.metrics()[abort] == 1


@pytest.mark.parametrize("idle_s", [0.2, 60.0])
def test_heap_trim_waits_for_an_idle_engine(monkeypatch, idle_s):
    """The heap goes back to the OS once the engine has been idle `IDLE_TRIM_S` after its last request (the
    response sent, its objects freed), once, never while a request runs; not at the moment the request ends."""
    import dspark.server.async_engine as async_engine
    calls = []
    monkeypatch.setattr(async_engine, "IDLE_TRIM_S", idle_s)
    engine = make_engine(build_tiny_model())
    monkeypatch.setattr(async_engine, "_trim_when_idle", lambda e: calls.append(e.has_unfinished()))
    with serve(engine) as srv:
        assert srv.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 6}
                        ).status_code == 200
        deadline = time.monotonic() + (20 if idle_s < 1 else 1.0)
        while time.monotonic() < deadline and not calls:
            time.sleep(0.02)
        time.sleep(0.5)
        assert calls == ([False] if idle_s < 1 else [])


def test_heap_trim_after_a_request_that_ends_in_its_first_step(monkeypatch):
    """A request that ends in the step that admitted it (one token: max_tokens=1, or EOS sampled first) arms
    the idle trim as well: once, after its end."""
    import dspark.server.async_engine as async_engine
    calls = []
    monkeypatch.setattr(async_engine, "IDLE_TRIM_S", 0.05)
    monkeypatch.setattr(async_engine, "_trim_when_idle", lambda e: calls.append(e.has_unfinished()))
    ae = AsyncEngine(make_engine(build_tiny_model()), CharTokenizer())

    async def one_token():
        stream = await ae.add_request([5, 6, 7], SamplingParams(max_tokens=1), "one")
        return [delta async for delta in stream]

    ae.start()
    try:
        deltas = asyncio.run(one_token())
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not calls:
            time.sleep(0.01)
        time.sleep(0.2)
    finally:
        ae.shutdown()
    assert [(d.finished, d.num_output_tokens) for d in deltas] == [(True, 1)]
    assert calls == [False]


def test_batched_prompts_come_back_in_prompt_order(plain):
    """A list of prompts (strings or id lists, what eval harnesses send) is answered as OpenAI and vLLM do:
    n choices per prompt, `index` = prompt * n + choice, each as the prompt alone would get it (greedy), the
    usage counting each prompt once; streamed chunks carry the same indexes; an empty prompt in the batch
    refuses the whole request before any of it runs."""
    base = {"model": MODEL, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    prompts = ["hello", "xyz!", "abc"]
    alone = [plain.post("/v1/completions", json={**base, "prompt": p}).json() for p in prompts]
    batch = plain.post("/v1/completions", json={**base, "prompt": prompts, "n": 2}).json()
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone for _ in range(2)]
    assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert batch["usage"]["completion_tokens"] == 30
    events = stream_events(plain, "/v1/completions", {**base, "prompt": prompts, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    texts = {}
    for e in events[:-1]:
        for c in json.loads(e)["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == [a["choices"][0]["text"] for a in alone]
    assert json.loads(events[-2])["usage"]["prompt_tokens"] == batch["usage"]["prompt_tokens"]
    echoed = plain.post("/v1/completions", json={**base, "prompt": ["ab", "cd"], "echo": True, "logprobs": 0,
                                                 "max_tokens": 0}).json()
    assert [c["text"] for c in echoed["choices"]] == ["ab", "cd"]
    assert [c["logprobs"]["tokens"] for c in echoed["choices"]] == [["a", "b"], ["c", "d"]]
    ids = plain.post("/v1/completions", json={**base, "prompt": [[5, 6, 7], [8, 9]]}).json()
    assert [c["text"] for c in ids["choices"]] == [
        plain.post("/v1/completions", json={**base, "prompt": p}).json()["choices"][0]["text"] for p in ([5, 6, 7], [8, 9])]
