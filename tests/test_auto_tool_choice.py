"""tool_choice "auto" through the server (`--enable-auto-tool-choice --tool-call-parser NAME`), with the
official `openai` client: a target scripted to write a hermes tool call returns parsed `tool_calls` with
`finish_reason: "tool_calls"` (whole, and streamed deltas as the client assembles them), a target that
writes text returns content, a reasoning parser takes the thoughts off first, and without the flags
"auto" is refused naming the field."""

from __future__ import annotations

import json

import pytest

from dspark.server.config import ServerConfig
from server_harness import CharTokenizer, ScriptedTarget, build_tiny_model, make_engine, serve

TOK = CharTokenizer()
MESSAGES = [{"role": "user", "content": "weather?"}]
PROMPT = TOK.apply_chat_template(MESSAGES)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
EOS = 2


def _server(script: str, **config):
    target = ScriptedTarget(build_tiny_model(), len(PROMPT), TOK.encode(script) + [EOS])
    return serve(make_engine(target), config=ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                                          **config))


def _create(srv, **kw):
    return srv.client().chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                                max_tokens=100, **kw)


def _assembled(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, calls by index, finish_reason) from stream chunks, as OpenAI's client code assembles them."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for entry in choice.delta.tool_calls or ():
                call = calls.setdefault(entry.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or entry.id
                if entry.function is not None:
                    call["name"] += entry.function.name or ""
                    call["arguments"] += entry.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, calls, reason


def test_a_tool_call_comes_back_parsed_whole_and_streamed():
    with _server("Checking. " + CALL) as srv:
        reply = _create(srv).choices[0]
        assert reply.finish_reason == "tool_calls"
        assert reply.message.content == "Checking."
        (call,) = reply.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert call.id.startswith("call_") and call.type == "function"
        content, calls, reason = _assembled(_create(srv, stream=True))
        assert reason == "tool_calls" and content.strip() == "Checking."
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]


def test_text_comes_back_as_content():
    with _server("It is sunny in Paris.") as srv:
        reply = _create(srv).choices[0]
        assert reply.finish_reason == "stop" and reply.message.content == "It is sunny in Paris."
        assert not reply.message.tool_calls
        content, calls, reason = _assembled(_create(srv, stream=True))
        assert (content, calls, reason) == ("It is sunny in Paris.", {}, "stop")


def test_a_malformed_call_comes_back_as_content_not_an_error():
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    with _server(broken) as srv:
        reply = _create(srv).choices[0]
        assert reply.finish_reason == "stop" and reply.message.content == broken


def test_reasoning_comes_off_before_the_call():
    with _server("<think>hm</think>" + CALL, reasoning_parser="qwen3") as srv:
        body = srv.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                                                      "temperature": 0.0, "max_tokens": 100}).json()
        message = body["choices"][0]["message"]
        assert message["reasoning_content"] == "hm"
        assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_auto_without_the_flags_is_refused_naming_the_field():
    with serve(make_engine(build_tiny_model())) as srv:
        resp = srv.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": TOOLS})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in resp.json()["error"]["message"]


def test_the_flags_are_checked():
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        ServerConfig(tool_call_parser="nope")


def test_offline_chat_parses_reasoning_and_calls():
    """`LLM.chat(..., reasoning_parser=, tool_parser=)`: the same parsers as the server, on each output; the
    whole text stays in `text`."""
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams
    script = "<think>hm</think>" + CALL
    target = ScriptedTarget(build_tiny_model(), len(PROMPT), TOK.encode(script) + [EOS])
    llm = LLM(engine=make_engine(target), tokenizer=TOK)
    (out,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=100), use_tqdm=False, tools=TOOLS,
                      reasoning_parser="qwen3", tool_parser="hermes")[0].outputs
    assert out.text == script and out.reasoning_content == "hm" and out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    plain = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=100), use_tqdm=False)[0].outputs[0]
    assert plain.text == script and plain.tool_calls is None and plain.reasoning_content is None


def test_strict_tools_return_only_calls_that_validate():
    """A `strict` tool: a call whose arguments do not validate against its parameters comes back as content
    (whole and streamed); a valid one as tool_calls."""
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    bad = '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>'
    with _server(bad) as srv:
        reply = srv.client().chat.completions.create(model="tiny", messages=MESSAGES, tools=strict, temperature=0.0,
                                                     max_tokens=100).choices[0]
        assert reply.finish_reason == "stop" and reply.message.content == bad and not reply.message.tool_calls
        content, calls, _ = _assembled(srv.client().chat.completions.create(
            model="tiny", messages=MESSAGES, tools=strict, temperature=0.0, max_tokens=100, stream=True))
        assert content == bad and calls == {}
        loose = _create(srv).choices[0]  # the same call without strict: returned as it was written
        assert loose.finish_reason == "tool_calls" and json.loads(loose.message.tool_calls[0].function.arguments) == \
            {"town": "Paris"}
    with _server(CALL) as srv:
        reply = srv.client().chat.completions.create(model="tiny", messages=MESSAGES, tools=strict, temperature=0.0,
                                                     max_tokens=100).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.tool_calls[0].function.name == "get_weather"
