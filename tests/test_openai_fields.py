"""Every OpenAI chat / completions request field, table-driven: honoured (an observable effect on the
response) or refused with a 400 naming it; vLLM's implemented extras honoured; an unknown field a 400.

The tables list OpenAI's request fields by name; a test checks that each field the request models
declare is in a table, so a new field cannot be accepted without a row here.

    pytest tests/test_openai_fields.py -q
"""

from __future__ import annotations

import json

import pytest

from dspark.server.protocol import ChatCompletionRequest, CompletionRequest
from server_harness import build_tiny_model, make_engine, serve, stream_events

USER = [{"role": "user", "content": "hello there"}]
BASE = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv():
    with serve(make_engine(build_tiny_model())) as s:
        yield s


def chat(srv, **fields):
    return srv.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, **BASE, **fields})


def completion(srv, **fields):
    return srv.post("/v1/completions", json={"model": "tiny", "prompt": "abcabcab", **BASE, **fields})


def text(resp) -> str:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# -- honoured: each check sends the field and asserts its effect --------------------------------------
def _differs(field, value):
    def check(srv, call):
        assert text(call(srv, **{field: value})) != text(call(srv)), f"{field} had no effect"
    return check


def _logit_bias(srv, call):
    out = text(call(srv, logit_bias={"40": 100}))  # token 40 is the character 'E'
    assert out == "E" * 12


def _min_tokens(srv, call):
    first = text(call(srv))[0]
    stop_id = 3 + ord(first) - 32
    assert text(call(srv, stop_token_ids=[stop_id])) == first  # the stop token ends the output
    assert len(text(call(srv, stop_token_ids=[stop_id], min_tokens=4))) >= 4


def _seed(srv, call):
    a = text(call(srv, temperature=1.0, seed=7))
    assert a == text(call(srv, temperature=1.0, seed=7))
    assert a != text(call(srv, temperature=1.0, seed=8))


def _top_k(srv, call):
    assert text(call(srv, temperature=1.5, seed=3, top_k=1)) == text(call(srv))


def _min_p(srv, call):
    assert text(call(srv, temperature=1.5, seed=3, min_p=1.0)) == text(call(srv))


def _top_p(srv, call):
    assert text(call(srv, temperature=1.5, seed=3, top_p=1e-6)) == text(call(srv))


def _temperature(srv, call):
    assert text(call(srv, temperature=1.5, seed=3)) != text(call(srv))


def _stop(srv, call):
    full = text(call(srv))
    assert text(call(srv, stop=[full[3:5]])) == full[:full.index(full[3:5])]


def _max_tokens(srv, call):
    assert len(text(call(srv, max_tokens=3))) == 3


def _n(srv, call):
    resp = call(srv, n=3, temperature=1.0, seed=5)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({json.dumps(c) for c in choices}) == 3
    assert resp.json()["usage"]["completion_tokens"] == 36


def _stream(srv, call):
    path = "/v1/chat/completions" if call is chat else "/v1/completions"
    body = {"model": "tiny", **BASE, **({"messages": USER} if call is chat else {"prompt": "abcabcab"})}
    events = stream_events(srv, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 12


def _logprobs_chat(srv, call):
    resp = call(srv, logprobs=True, top_logprobs=3)
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 12 and all(len(c["top_logprobs"]) == 3 for c in content)
    assert all(c["logprob"] == c["top_logprobs"][0]["logprob"] for c in content)  # greedy: the top one


def _logprobs_completion(srv, call):
    lp = call(srv, logprobs=2).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 12 and all(len(t) <= 2 for t in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == text(call(srv))


def _echo(srv, call):
    assert text(call(srv, echo=True)) == "abcabcab" + text(call(srv))


def _prompt_logprobs(srv, call):
    body = call(srv, prompt_logprobs=2).json()
    entries = body["prompt_logprobs"] if call is chat else body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == body["usage"]["prompt_tokens"] > 1
    assert all(2 <= len(e) <= 3 and all({"logprob", "rank", "decoded_token"} == set(v) for v in e.values())
               for e in entries[1:])
    assert call(srv).json()["choices"][0].get("prompt_logprobs") is None


def _ignore_eos(srv, call):
    assert call(srv, ignore_eos=False).status_code == 200  # the tiny model never says EOS; accepted


def _include_stop_str(srv, call):
    full = text(call(srv))
    assert text(call(srv, stop=[full[3:5]], include_stop_str_in_output=True)) == full[:full.index(full[3:5]) + 2]


def _speculation(srv, call):
    assert text(call(srv, speculation=False)) == text(call(srv))


def _no_effect(field, value):
    """Identifiers and hints that ask for nothing the output could show: accepted, output unchanged."""
    def check(srv, call):
        assert text(call(srv, **{field: value})) == text(call(srv))
    return check


def _bad_words(srv, call):
    full = text(call(srv))
    assert full[2] not in text(call(srv, bad_words=[full[2]]))


def _allowed(srv, call):
    assert set(text(call(srv, allowed_token_ids=[40, 41]))) <= {"E", "F"}


def _max_completion_tokens(srv, call):
    assert len(text(call(srv, max_tokens=None, max_completion_tokens=4))) == 4


def _chat_template(srv, call):
    resp = call(srv, chat_template="unused by the character tokenizer")
    assert resp.status_code in (200, 400)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def _structured(field, value, check):
    def run(srv, call):
        out = text(call(srv, max_tokens=80, **{field: value}))
        assert check(out), f"{field}: {out!r}"
    return run


def _valid_json(out: str) -> bool:
    import jsonschema
    jsonschema.validate(json.loads(out), SCHEMA)
    return True


STRUCTURED = {
    "response_format": _structured("response_format", {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}, _valid_json),
    "structured_outputs": _structured("structured_outputs", {"json": SCHEMA}, _valid_json),
    "guided_json": _structured("guided_json", SCHEMA, _valid_json),
    "guided_regex": _structured("guided_regex", "[a-d]{2,4}!", lambda t: __import__("re").fullmatch("[a-d]{2,4}!", t)),
    "guided_choice": _structured("guided_choice", ["yes", "no"], lambda t: t in ("yes", "no")),
    "guided_grammar": _structured("guided_grammar", 'start: "x" ("y" | "w") "z"',
                                  lambda t: t in ("xyz", "xwz")),
}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                   "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "noop", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


def _tool_calls(srv, call):
    import jsonschema
    for choice, names in (("required", {"get_weather", "noop"}),
                          ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})):
        for stream in (False, True):
            body = {"model": "tiny", "messages": USER, **BASE, "ignore_eos": False, "max_tokens": 60, "tools": TOOLS,
                    "tool_choice": choice}
            if stream:
                events = stream_events(srv, "/v1/chat/completions", {**body, "stream": True})
                last = [json.loads(e) for e in events[:-1] if json.loads(e)["choices"]][-1]["choices"][0]
                calls, finish = last["delta"]["tool_calls"], last["finish_reason"]
            else:
                resp = srv.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
                msg = resp.json()["choices"][0]
                calls, finish = msg["message"]["tool_calls"], msg["finish_reason"]
                assert msg["message"]["content"] is None
            assert finish == "tool_calls" and len(calls) == 1
            fn = calls[0]["function"]
            assert fn["name"] in names
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn["name"])
            jsonschema.validate(json.loads(fn["arguments"]), schema)


def _add_generation_prompt(srv, call):
    assert text(call(srv, add_generation_prompt=False)) != text(call(srv))


COMMON = {
    "model": _no_effect("model", "tiny"),
    "temperature": _temperature, "top_p": _top_p, "top_k": _top_k, "min_p": _min_p, "seed": _seed,
    "stop": _stop, "stop_token_ids": _min_tokens, "ignore_eos": _ignore_eos, "stream": _stream,
    "stream_options": _stream, "n": _n, "speculation": _speculation,
    "include_stop_str_in_output": _include_stop_str,
    "presence_penalty": _differs("presence_penalty", 2.0), "frequency_penalty": _differs("frequency_penalty", 2.0),
    "repetition_penalty": _differs("repetition_penalty", 3.0), "logit_bias": _logit_bias,
    "min_tokens": _min_tokens, "bad_words": _bad_words, "allowed_token_ids": _allowed,
    "user": _no_effect("user", "u-1"), "prompt_cache_key": _no_effect("prompt_cache_key", "k"),
    "safety_identifier": _no_effect("safety_identifier", "s"), "max_tokens": _max_tokens,
    "service_tier": _no_effect("service_tier", "auto"), "store": _no_effect("store", False),
    **STRUCTURED,
}
HONOURED = {
    "chat": {**COMMON, "messages": _no_effect("messages", USER), "logprobs": _logprobs_chat,
             "top_logprobs": _logprobs_chat, "max_completion_tokens": _max_completion_tokens,
             "parallel_tool_calls": _no_effect("parallel_tool_calls", True),
             "modalities": _no_effect("modalities", ["text"]), "chat_template": _chat_template,
             "chat_template_kwargs": _no_effect("chat_template_kwargs", {}),
             "add_generation_prompt": _add_generation_prompt, "tools": _tool_calls, "tool_choice": _tool_calls,
             "prompt_logprobs": _prompt_logprobs},
    "completions": {**COMMON, "prompt": _no_effect("prompt", "abcabcab"), "logprobs": _logprobs_completion,
                    "echo": _echo, "best_of": _no_effect("best_of", 1), "prompt_logprobs": _prompt_logprobs},
}

# -- refused: the field with a value that asks for something the server does not do ---------------
COMMON_REFUSED = {
    "use_beam_search": True, "length_penalty": 0.5, "logits_processors": ["x"],
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 4,
    "priority": 1, "return_tokens_as_token_ids": True, "service_tier": "flex", "store": True,
    "metadata": {"a": "b"}, "add_special_tokens": True, "no_stop_trim": True, "return_hidden_states": True,
    "response_format": {"type": "json_schema"}, "structured_outputs": {"json": 1, "regex": "a"},
    "guided_json": "{not json", "guided_regex": "a(", "guided_choice": [],
    "guided_grammar": "start: nothing_defined",
}
REFUSED = {
    "chat": {**COMMON_REFUSED, "audio": {"voice": "alloy"}, "modalities": ["text", "audio"],
             "functions": [{"name": "f"}], "function_call": "auto", "prediction": {"type": "content"},
             "reasoning_effort": "high", "verbosity": "low", "web_search_options": {}, "documents": [{}],
             "continue_final_message": True, "echo": True, "separate_reasoning": False,
             "stream_reasoning": False, "include_reasoning": False,
             "tools": TOOLS,  # tool_choice "auto" (the default with tools): no parser for the model's format
             "tool_choice": "required"},  # without tools
    "completions": {**COMMON_REFUSED, "suffix": "tail", "best_of": 3, "add_special_tokens": False},
}
# OpenAI's documented request fields (chat completions and legacy completions APIs).
OPENAI_FIELDS = {
    "chat": {"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
             "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
             "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
             "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
             "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
             "verbosity", "web_search_options"},
    "completions": {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
                    "suffix", "temperature", "top_p", "user"},
}
CALLS = {"chat": chat, "completions": completion}
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_field_is_in_a_table(endpoint):
    covered = set(HONOURED[endpoint]) | set(REFUSED[endpoint])
    assert OPENAI_FIELDS[endpoint] <= covered, OPENAI_FIELDS[endpoint] - covered
    assert set(MODELS[endpoint].model_fields) <= covered, set(MODELS[endpoint].model_fields) - covered


@pytest.mark.parametrize("endpoint,field", [(e, f) for e in HONOURED for f in HONOURED[e]])
def test_honoured_field_has_its_effect(srv, endpoint, field):
    HONOURED[endpoint][field](srv, CALLS[endpoint])


@pytest.mark.parametrize("endpoint,field", [(e, f) for e in REFUSED for f in REFUSED[e]])
def test_refused_field_is_a_400_naming_it(srv, endpoint, field):
    resp = CALLS[endpoint](srv, **{field: REFUSED[endpoint][field]})
    assert resp.status_code == 400, (field, resp.text)
    err = resp.json()["error"]
    assert field in err["message"] or err["param"] == field, err


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_unknown_field_is_a_400_naming_it(srv, endpoint):
    resp = CALLS[endpoint](srv, frobnicate=1)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "Unrecognized request argument supplied: frobnicate"
    resp = CALLS[endpoint](srv, stream_options={"include_usage": True, "bogus": 1})
    assert resp.status_code == 400 and "bogus" in resp.json()["error"]["message"]


def test_n_choices_share_the_prompt_through_the_prefix_cache(srv):
    prompt = "the quick brown fox jumps over the lazy dog " * 2
    m = srv.engine.metrics
    before = m.num_prompt_tokens
    resp = srv.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "n": 3, "max_tokens": 4,
                                             "temperature": 1.0, "seed": 1})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 3
    computed = m.num_prompt_tokens - before
    assert computed < 1.5 * len(prompt), f"{computed} prompt tokens computed for 3 choices of {len(prompt)}"
