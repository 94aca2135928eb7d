"""Hostile requests against the real server (tiny Llama behind uvicorn): each gets its 4xx with
OpenAI's error body, and the server answers a normal request right after with every KV block free.
Also: the body-size limit, unknown routes and methods, and fields of every type that must not coerce.
"""

from __future__ import annotations

import json

import httpx
import pytest

from dspark.server.config import ServerConfig
from server_harness import MAX_MODEL_LEN, MODEL, build_tiny_model, make_engine, serve

BODY_LIMIT = 64 * 1024
J = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def srv():
    with serve(make_engine(build_tiny_model()),
               config=ServerConfig(max_request_body_bytes=BODY_LIMIT)) as s:
        yield s


def cmpl(**fields) -> dict:
    return {"json": {"model": MODEL, "prompt": "hi", **fields}}


def chat(messages, **fields) -> dict:
    return {"json": {"model": MODEL, "messages": messages, **fields}}


def raw(body: bytes, headers=J) -> dict:
    return {"content": body, "headers": headers}


C, CH = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "x"}]

# (id, path, request kwargs, status, a piece of the message)
HOSTILE = [
    # lengths against the context: 400 with the numbers
    ("max_tokens_10M", C, cmpl(max_tokens=10_000_000), 400,
     "you requested 10000002 tokens (2 in the prompt, 10000000 in the completion)"),
    ("prompt_plus_max", C, cmpl(prompt="y" * 100, max_tokens=40), 400,
     f"maximum context length is {MAX_MODEL_LEN} tokens. However, you requested 140 tokens"),
    ("prompt_too_long", C, cmpl(prompt="y" * (MAX_MODEL_LEN + 5)), 400, "maximum model length"),
    ("chat_max_completion", CH, chat(U, max_completion_tokens=10**9), 400, "maximum context"),
    ("chat_huge_message", CH, chat([{"role": "user", "content": "z" * 50_000}]), 400,
     "maximum model length"),
    ("chat_many_messages", CH, chat([{"role": "user", "content": ""}] * 2000), 400,
     "maximum model length"),
    # ranges
    ("max_tokens_0", C, cmpl(max_tokens=0), 400, "max_tokens"),
    ("max_tokens_neg", C, cmpl(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens_2e40", C, cmpl(max_tokens=2**40), 400, "max_tokens"),
    ("temperature_neg", C, cmpl(temperature=-1), 400, "temperature"),
    ("temperature_1e300", C, cmpl(temperature=1e300), 400, "temperature"),
    ("top_p_0", C, cmpl(top_p=0), 400, "top_p"),
    ("top_p_1.5", C, cmpl(top_p=1.5), 400, "top_p"),
    ("top_k_1e30", C, cmpl(top_k=10**30, temperature=0.5), 400, "top_k"),  # once killed the loop
    ("top_k_neg", C, cmpl(top_k=-5), 400, "top_k"),
    ("seed_2e70", C, cmpl(seed=2**70), 400, "seed"),
    ("n_0", C, cmpl(n=0), 400, "n"),
    ("stop_empty", C, cmpl(stop=[""]), 400, "stop"),
    ("stop_many", C, cmpl(stop=[f"s{i}" for i in range(65)]), 400, "at most 64 stop strings"),
    ("stop_long", C, cmpl(stop="s" * 5000), 400, "at most 4096 characters"),
    ("stop_token_out_of_vocab", C, cmpl(stop_token_ids=[10**6]), 400, "outside the vocabulary"),
    ("stop_token_neg", C, cmpl(stop_token_ids=[-1]), 400, "stop_token_ids must be >= 0"),
    ("prompt_token_neg", C, cmpl(prompt=[-1]), 400, "outside the vocabulary"),
    ("prompt_token_huge", C, cmpl(prompt=[2**70]), 400, "outside the vocabulary"),
    ("prompt_empty", C, cmpl(prompt=""), 400, "empty"),
    ("prompt_empty_ids", C, cmpl(prompt=[]), 400, "empty"),
    ("prompt_empty_nested", C, cmpl(prompt=[[]]), 400, "empty"),
    ("prompt_batch_too_large", C, cmpl(prompt=["a"] * 257), 400, "at most 256 prompts"),
    ("prompt_batch_one_empty", C, cmpl(prompt=["a", ""]), 400, "empty"),
    # types: nothing coerces
    ("max_tokens_str", C, cmpl(max_tokens="2"), 400, "'max_tokens'"),
    ("max_tokens_bool", C, cmpl(max_tokens=True), 400, "'max_tokens'"),
    ("max_tokens_float", C, cmpl(max_tokens=2.5), 400, "'max_tokens'"),
    ("temperature_str", C, cmpl(temperature="hot"), 400, "temperature"),
    ("seed_str", C, cmpl(seed="1"), 400, "seed"),
    ("stream_str", C, cmpl(stream="yes"), 400, "stream"),
    ("ignore_eos_int", C, cmpl(ignore_eos=1), 400, "ignore_eos"),
    ("stream_options_bad", C, cmpl(stream=True, stream_options={"include_usage": "x"}), 400,
     "stream_options"),
    ("prompt_object", C, cmpl(prompt={"a": 1}), 400, "prompt"),
    ("prompt_null", C, cmpl(prompt=None), 400, "prompt"),
    ("prompt_bool_ids", C, cmpl(prompt=[1, True]), 400, "prompt"),
    ("prompt_missing", C, {"json": {"model": MODEL}}, 400, "prompt"),
    ("model_int", C, cmpl(model=123), 400, "model"),
    ("messages_str", CH, chat("hi"), 400, "messages"),
    ("messages_empty", CH, chat([]), 400, "messages"),
    ("message_no_role", CH, chat([{"content": "x"}]), 400, "role"),
    ("message_role_int", CH, chat([{"role": 5, "content": "x"}]), 400, "role"),
    ("message_role_unknown", CH, chat([{"role": "wizard", "content": "x"}]), 400, "wizard"),
    ("message_image", CH, chat([{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "image_url"),
    ("message_content_int", CH, chat([{"role": "user", "content": 7}]), 400, "content"),
    # unknown models
    ("model_unknown", C, cmpl(model="gpt-17"), 404, "gpt-17"),
    ("chat_model_unknown", CH, chat(U, model="nope"), 404, "nope"),
    # bytes at the edge
    ("json_malformed", CH, raw(b'{"model": "tiny", "messages": ['), 400, "malformed JSON"),
    ("json_nan", C, raw(b'{"model": "tiny", "prompt": "x", "temperature": NaN}'), 400, "NaN"),
    ("json_infinity", C, raw(b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}'), 400,
     "Infinity"),
    ("invalid_utf8", C, raw(b'{"model": "tiny", "prompt": "\xff\xfe"}'), 400, "not valid UTF-8"),
    ("lone_surrogate", C, raw(b'{"model": "tiny", "prompt": "a\\ud800b"}'), 400, "surrogate"),
    ("surrogate_in_chat", CH, raw(b'{"model": "tiny", "messages": [{"role": "user", '
                                  b'"content": "\\udfff"}]}'), 400, "surrogate"),
    ("deep_nesting", C, raw(b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"), 400,
     "nested deeper than 32"),
    ("moderate_nesting", C, raw(b'{"model": "tiny", "prompt": "x", "extra": '
                                + b"[" * 40 + b"]" * 40 + b"}"), 400, "nested deeper than 32"),
    ("empty_body", C, raw(b""), 400, "empty"),
    ("body_array", C, raw(b"[1, 2]"), 400, "invalid request body"),
    ("body_null", C, raw(b"null"), 400, "invalid request body"),
    ("text_plain", C, raw(b'{"model": "tiny", "prompt": "x"}', {"content-type": "text/plain"}),
     415, "application/json"),
    ("form", C, raw(b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}), 415,
     "application/json"),
    ("no_content_type", C, raw(b'{"model": "tiny", "prompt": "x"}', {}), 415, "application/json"),
    ("body_too_big", C, raw(json.dumps({"model": MODEL, "prompt": "x" * BODY_LIMIT}).encode()),
     413, f"limit of {BODY_LIMIT} bytes"),
    ("unknown_route", "/v1/nothing", {"json": {}}, 404, "Not Found"),
]


@pytest.mark.parametrize("path,kwargs,status,needle", [h[1:] for h in HOSTILE],
                         ids=[h[0] for h in HOSTILE])
def test_hostile_request_is_4xx_and_the_server_keeps_serving(srv, path, kwargs, status, needle):
    resp = srv.post(path, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert needle in error["message"], error
    ok = srv.post(C, json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    srv.wait_idle()


def test_body_limit_without_content_length(srv):
    """A chunked body is counted as it arrives: refused once past the limit."""
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    resp = httpx.post(srv.base_url + C, content=chunks(), headers=J, timeout=30)
    assert resp.status_code == 413 and "limit" in resp.json()["error"]["message"]
    assert srv.post(C, json={"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200


def test_wrong_method_and_param_names(srv):
    resp = httpx.get(srv.base_url + C, timeout=10)
    assert resp.status_code == 405 and "error" in resp.json()
    resp = srv.post(C, **cmpl(temperature=-2))
    assert resp.json()["error"]["param"] == "temperature"
    resp = srv.post(C, **cmpl(max_tokens="2"))
    assert resp.json()["error"]["param"] == "max_tokens"
    resp = srv.post(C, **cmpl(max_tokens=500))
    assert resp.json()["error"]["param"] == "max_tokens"


def test_a_body_just_under_the_limit_is_served(srv):
    """The limit refuses only what is over it: a 60 KiB body whose prompt is token ids."""
    ids = [5] * 20
    body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 2, "user": "u" * 60_000})
    assert len(body) < BODY_LIMIT
    resp = srv.post(C, content=body.encode(), headers=J)
    assert resp.status_code == 200, resp.text


def test_a_vanishing_repetition_penalty_is_refused_not_sampled_from(srv):
    """A repetition penalty of 5e-324 (what the schema fuzz found) divided positive logits to +inf, the
    keyed draw returned a token past the vocabulary and the engine stopped: it is refused with a 400."""
    resp = srv.post("/v1/completions", **cmpl(repetition_penalty=5e-324))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "repetition_penalty"
    ok = srv.post("/v1/completions", **cmpl(repetition_penalty=0.01))
    assert ok.status_code == 200


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_constraints_no_token_satisfies_end_the_request_with_a_400(srv, temperature, stream):
    """min_tokens beyond where a grammar must end (guided_choice "a", EOS held back 5 tokens) leaves a
    position no token may take: the request ends with a 400 saying so, nothing drawn from the empty row
    reaches the engine (a draw from it returned a token past the vocabulary and stopped the engine), and
    the server keeps serving."""
    body = cmpl(guided_choice=["a"], min_tokens=5, max_tokens=8, temperature=temperature, stream=stream)
    resp = srv.post("/v1/completions", **body)
    if stream:
        assert resp.status_code == 200
        error = [json.loads(e[len("data: "):]) for e in resp.text.split("\n\n") if e.startswith("data: {")][-1]
        assert error["error"]["code"] == 400, error
        assert "no token may follow" in error["error"]["message"]
    else:
        assert resp.status_code == 400 and "no token may follow" in resp.json()["error"]["message"]
    assert srv.post("/v1/completions", **cmpl(max_tokens=2)).status_code == 200
