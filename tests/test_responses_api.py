"""`/v1/responses` (OpenAI's Responses API) end to end, with the official `openai` client and raw SSE: a target
scripted to write text, a hermes tool call or a think block comes back as the output items OpenAI's types read
(whole, and streamed as typed events whose last carries the same response); a string input and an item list;
instructions; a function tool round trip whose second prompt (the one the engine got) carries the tool's output;
tool_choice "required" and named; reasoning items; text.format json_schema; max_output_tokens → incomplete;
fields it cannot honour refused naming them; greedy output equal to /v1/chat/completions for the same conversation,
with a drafter and without; the same tool loop through chat completions; and one OpenAI Agents SDK run where the
package is installed.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from dspark.config import SpecConfig
from dspark.server.config import ServerConfig
from server_harness import (MAX_MODEL_LEN, CharTokenizer, ScriptedTarget, build_tiny_model, make_engine, serve,
                            slowed)

EOS = 2
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
ARGS = '{"city": "Paris"}'  # the hermes parser's spelling of the call's arguments
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
USER = [{"role": "user", "content": "weather?"}]


class ToolTokenizer(CharTokenizer):
    """The harness's character tokenizer with a template that renders tool calls and `tool` messages."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        text = ""
        for m in messages:
            assert m["role"] in ("system", "user", "assistant", "tool"), m
            calls = "".join(f"<tool_call>{c['function']['name']} {c['function']['arguments']}</tool_call>"
                            for c in m.get("tool_calls") or ())
            text += f"{m['role']}: {m['content'] or ''}{calls}\n"
        return [1] + self.encode(text + ("assistant: " if add_generation_prompt else ""))


TOK = ToolTokenizer()


def _target(*scripts: tuple[list[dict], str]) -> ScriptedTarget:
    """A target that answers each conversation (by its prompt's length) with its script, then EOS."""
    target = ScriptedTarget(build_tiny_model(), 0, [])
    for messages, text in scripts:
        start = len(TOK.apply_chat_template(messages))
        script = {start + i: t for i, t in enumerate(TOK.encode(text) + [EOS])}
        assert not set(script) & set(target.script), "two scripts overlap"
        assert max(script) < MAX_MODEL_LEN, "a script past the model's length"
        target.script.update(script)
    return target


def _server(*scripts, spec: SpecConfig | None = None, **config):
    engine = make_engine(_target(*scripts) if scripts else build_tiny_model(), spec=spec)
    return serve(engine, config=ServerConfig(**config), tokenizer=TOK)


def _auto(*scripts, **config):
    return _server(*scripts, enable_auto_tool_choice=True, tool_call_parser="hermes", **config)


def _prompts(srv) -> list[str]:
    """The prompts the engine gets from now on, decoded (the list fills as requests come)."""
    prompts, real = [], srv.async_engine.add_requests

    async def add_requests(requests, **kw):
        prompts.extend(TOK.decode(ids) for ids, _, _ in requests)
        return await real(requests, **kw)
    srv.async_engine.add_requests = add_requests
    return prompts


def _rendered(messages) -> str:
    return TOK.decode(TOK.apply_chat_template(messages))


def _events(srv, body: dict) -> list[dict]:
    """The typed events of a streamed response, checking the framing and the numbering."""
    with httpx.stream("POST", srv.base_url + "/v1/responses", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = resp.read().decode()
    blocks = text.split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    return events


def _without_ids(response: dict) -> dict:
    """A response with what differs between two runs of one request left out (ids, times, cache hits)."""
    out = {k: v for k, v in response.items() if k not in ("id", "created_at", "usage")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    usage = dict(response["usage"] or {})
    usage.pop("input_tokens_details", None)
    return {**out, "usage": usage}


def _whole_and_streamed(srv, body: dict) -> tuple[dict, list[dict]]:
    """The whole response and the streamed events of one request; the last event carries the same response, and the
    deltas add up to its items."""
    whole = srv.post("/v1/responses", json=body)
    assert whole.status_code == 200, whole.text
    whole = whole.json()
    events = _events(srv, body)
    final = events[-1]["response"]
    assert events[-1]["type"] == {"completed": "response.completed"}.get(final["status"], "response.incomplete")
    assert _without_ids(final) == _without_ids(whole)
    for index, item in enumerate(final["output"]):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["type"] == "response.output_item.added" and mine[-1] == {
            "type": "response.output_item.done", "sequence_number": mine[-1]["sequence_number"],
            "output_index": index, "item": item}
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        if item["type"] == "function_call":
            assert deltas == item["arguments"]
        else:
            assert deltas == item["content"][0]["text"]
    return whole, events


# -- text ---------------------------------------------------------------------------------------------------------
def test_text_whole_and_streamed_with_the_official_client():
    with _server((USER, "It is sunny.")) as srv:
        client = srv.client()
        r = client.responses.create(model="tiny", input="weather?", temperature=0.0)
        assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
        assert r.output_text == "It is sunny." and r.store is False and r.model == "tiny"
        (item,) = r.output
        assert item.type == "message" and item.role == "assistant" and item.status == "completed"
        assert item.id.startswith("msg_") and item.content[0].type == "output_text"
        assert r.usage.input_tokens == len(TOK.apply_chat_template(USER))
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.incomplete_details is None
        with client.responses.stream(model="tiny", input="weather?", temperature=0.0) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert "".join(deltas) == final.output_text == r.output_text
        assert [i.type for i in final.output] == ["message"]
        raw = list(client.responses.create(model="tiny", input="weather?", temperature=0.0, stream=True))
        assert raw[-1].type == "response.completed" and raw[-1].response.output_text == r.output_text
        prompts = _prompts(srv)  # the answer fed back (as the client dumps it) is the assistant's turn
        again = USER + [item.to_dict() for item in r.output] + [{"role": "user", "content": "and tomorrow?"}]
        follow = client.responses.create(model="tiny", input=again, max_output_tokens=2, temperature=0.0)
        assert follow.status == "incomplete"
        assert prompts == [_rendered(USER + [{"role": "assistant", "content": "It is sunny."},
                                             {"role": "user", "content": "and tomorrow?"}])]
        whole, events = _whole_and_streamed(srv, {"model": "tiny", "input": "weather?", "temperature": 0.0})
        assert [e["type"] for e in events if "delta" not in e["type"]] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]


def test_item_list_input_and_instructions_render_as_chat_messages():
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use metric."},
                    {"role": "user", "content": "weather?\nin Paris"}]
    with _server((conversation, "Sunny.")) as srv:
        prompts = _prompts(srv)
        items = [{"type": "message", "role": "developer", "content": "Use metric."},
                 {"role": "user", "content": [{"type": "input_text", "text": "weather?"},
                                              {"type": "input_text", "text": "in Paris"}]}]
        r = srv.client().responses.create(model="tiny", instructions="Be brief.", input=items, temperature=0.0)
        assert r.output_text == "Sunny." and r.instructions == "Be brief."
        assert prompts == [_rendered(conversation)]


def test_max_output_tokens_makes_the_response_incomplete():
    with _server((USER, "It is sunny.")) as srv:
        body = {"model": "tiny", "input": "weather?", "temperature": 0.0, "max_output_tokens": 5}
        whole, events = _whole_and_streamed(srv, body)
        assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
        assert whole["output"][0]["content"][0]["text"] == "It is" and whole["output"][0]["status"] == "incomplete"
        assert whole["usage"]["output_tokens"] == 5 and whole["max_output_tokens"] == 5
        assert events[-1]["type"] == "response.incomplete"


# -- tools -------------------------------------------------------------------------------------------------------
def test_a_function_tool_round_trip():
    """The model calls the tool; the client appends the call and its output; the second prompt carries them; the
    model answers."""
    called = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "get_weather", "arguments": ARGS}}]}, {"role": "tool", "content": "21C, sunny"}]
    with _auto((USER, CALL), (called, "It is 21C.")) as srv:
        prompts, client = _prompts(srv), srv.client()
        first = client.responses.create(model="tiny", input=USER, tools=[TOOL], temperature=0.0)
        (call,) = first.output
        assert call.type == "function_call" and call.name == "get_weather" and call.arguments == ARGS
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        assert first.status == "completed" and first.tools[0].name == "get_weather" and first.tool_choice == "auto"
        followup = USER + [item.to_dict() for item in first.output] + [
            {"type": "function_call_output", "call_id": call.call_id, "output": "21C, sunny"}]
        second = client.responses.create(model="tiny", input=followup, tools=[TOOL], temperature=0.0)
        assert second.output_text == "It is 21C."
        assert prompts[-1] == _rendered(called) and "tool: 21C, sunny" in prompts[-1]
        whole, events = _whole_and_streamed(srv, {"model": "tiny", "input": USER, "tools": [TOOL], "temperature": 0.0})
        assert [e["type"] for e in events[2:]] == [
            "response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
        assert events[2]["item"]["arguments"] == "" and events[4]["name"] == "get_weather"
        with client.responses.stream(model="tiny", input=USER, tools=[TOOL], temperature=0.0) as stream:
            (streamed,) = stream.get_final_response().output
        assert (streamed.type, streamed.name, streamed.arguments) == ("function_call", "get_weather", ARGS)


def test_tool_choice_required_and_named():
    compact = '{"city":"Paris"}'
    for choice, script in (("required", '{"name":"get_weather","arguments":' + compact + '}'),
                           ({"type": "function", "name": "get_weather"}, compact)):
        with _server((USER, script)) as srv:
            body = {"model": "tiny", "input": USER, "tools": [TOOL], "tool_choice": choice, "temperature": 0.0}
            whole, _ = _whole_and_streamed(srv, body)
            (call,) = whole["output"]
            assert call["type"] == "function_call" and call["name"] == "get_weather"
            assert json.loads(call["arguments"]) == {"city": "Paris"} and whole["tool_choice"] == choice
            # "required" without tools, and a function that is not a tool, are refused naming tool_choice
            for bad in ({"tools": None}, {"tool_choice": {"type": "function", "name": "nope"}}):
                resp = srv.post("/v1/responses", json={**body, **bad})
                assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice", resp.text


def test_reasoning_items_with_a_reasoning_parser():
    """Thoughts come back as a reasoning item before the call (whole and streamed); fed back, the item is dropped.
    (A one-letter tool: the two turns fit the harness's 128 tokens.)"""
    tool = {"type": "function", "name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}
    call = '<tool_call>{"name": "w", "arguments": {"c": "P"}}</tool_call>'
    called = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "w", "arguments": '{"c": "P"}'}}]},
        {"role": "tool", "content": "21C, sunny, light breeze."}]
    with _auto((USER, "<think>h</think>" + call), (called, "<think>k</think>21C."), reasoning_parser="qwen3") as srv:
        prompts, client = _prompts(srv), srv.client()
        whole, events = _whole_and_streamed(srv, {"model": "tiny", "input": USER, "tools": [tool], "temperature": 0.0})
        reasoning, function_call = whole["output"]
        assert reasoning["type"] == "reasoning" and reasoning["summary"] == [] and reasoning["id"].startswith("rs_")
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "h"}]
        assert function_call["type"] == "function_call" and function_call["name"] == "w"
        assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 1
        assert "response.reasoning_text.delta" in [e["type"] for e in events]
        first = client.responses.create(model="tiny", input=USER, tools=[tool], temperature=0.0)
        followup = USER + [item.to_dict() for item in first.output] + [
            {"type": "function_call_output", "call_id": first.output[1].call_id, "output": "21C, sunny, light breeze."}]
        second = client.responses.create(model="tiny", input=followup, tools=[tool], temperature=0.0)
        assert [item.type for item in second.output] == ["reasoning", "message"]
        assert second.output_text == "21C." and second.output[0].content[0].text == "k"
        assert prompts[-1] == _rendered(called), "the reasoning item fed back is dropped"


def test_text_format_json_schema():
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
    with _server() as srv:  # the random model's own choices, held to the schema by the grammar
        body = {"model": "tiny", "input": "yes or no?", "temperature": 0.0, "text": {"format": fmt},
                "max_output_tokens": 60}
        whole, _ = _whole_and_streamed(srv, body)
        assert whole["status"] == "completed" and whole["text"] == {"format": fmt}
        jsonschema.validate(json.loads(whole["output"][0]["content"][0]["text"]), schema)
        loose = srv.post("/v1/responses", json={**body, "text": {"format": {"type": "json_object"}}}).json()
        assert loose["output"][0]["content"][0]["text"].startswith("{")  # held to an object (cut off mid-key here)
        free = srv.post("/v1/responses", json={**body, "text": {"format": {"type": "text"}}}).json()
        assert not free["output"][0]["content"][0]["text"].startswith("{")


def test_a_request_past_its_deadline_fails_whole_and_streamed():
    engine = slowed(make_engine(_target((USER, "la" * 45))), 0.02)
    with serve(engine, config=ServerConfig(request_timeout_s=0.3), tokenizer=TOK) as srv:
        body = {"model": "tiny", "input": USER, "temperature": 0.0}
        resp = srv.post("/v1/responses", json=body)
        assert resp.status_code == 504 and "deadline" in resp.json()["error"]["message"], resp.text
        events = _events(srv, body)
        failed = events[-1]["response"]
        assert events[-1]["type"] == "response.failed" and failed["status"] == "failed"
        assert failed["error"]["code"] == "server_error" and "deadline" in failed["error"]["message"]
        assert "response.output_text.delta" in [e["type"] for e in events]
        srv.wait_idle()


# -- refusals -----------------------------------------------------------------------------------------------------
REFUSED = [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**TOOL, "name": "bad name"}], "tool_choice": "required"}, "tools[0].name"),
    ({"tools": [{**TOOL, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [TOOL]}, "tool_choice"),  # "auto" without --enable-auto-tool-choice
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}, "tools": [TOOL]}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "callid": "c", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "extra": 1}]}, "input[0].extra"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}}}, "text.format"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "other"}, "model"),
]


@pytest.fixture(scope="module")
def plain():
    with _server() as srv:
        yield srv


@pytest.mark.parametrize("fields,param", REFUSED, ids=[p for _, p in REFUSED])
def test_what_cannot_be_honoured_is_refused_naming_the_field(plain, fields, param):
    for stream in (False, True):
        resp = plain.post("/v1/responses", json={"model": "tiny", "input": "hi", "stream": stream, **fields})
        assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param, resp.text


def test_store_is_accepted_and_nothing_is_stored(plain):
    for store in (True, False, None):
        r = plain.post("/v1/responses", json={"model": "tiny", "input": "hi", "store": store, "max_output_tokens": 2,
                                              "metadata": {"k": "v"}, "user": "u", "parallel_tool_calls": False})
        assert r.status_code == 200 and r.json()["store"] is False
        assert r.json()["metadata"] == {"k": "v"} and r.json()["parallel_tool_calls"] is False


# -- the same output as chat completions ----------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "ngram-drafter"])
def test_greedy_output_equals_chat_completions(drafter):
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3) \
        if drafter else None
    with _server(spec=spec) as srv:
        client = srv.client()
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "abc abc"}],
            temperature=0.0, max_tokens=40).choices[0].message.content
        body = {"model": "tiny", "instructions": "Be brief.", "input": "abc abc", "temperature": 0.0,
                "max_output_tokens": 40}
        whole, events = _whole_and_streamed(srv, body)
        assert chat.strip() and whole["output"][0]["content"][0]["text"] == chat
        if drafter:
            assert srv.engine.metrics.num_drafts > 0 and whole["usage"]["spec"]["num_drafts"] > 0
        off = srv.post("/v1/responses", json={**body, "speculation": False}).json()
        assert off["output"][0]["content"][0]["text"] == chat


def test_the_same_tool_loop_through_chat_completions():
    called = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "get_weather", "arguments": ARGS}}]}, {"role": "tool", "content": "21C, sunny"}]
    with _auto((USER, CALL), (called, "It is 21C.")) as srv:
        prompts, client = _prompts(srv), srv.client()
        message = client.chat.completions.create(model="tiny", messages=USER, tools=[CHAT_TOOL],
                                                 temperature=0.0).choices[0].message
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == ARGS
        messages = USER + [message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "21C, sunny"}]
        answer = client.chat.completions.create(model="tiny", messages=messages, tools=[CHAT_TOOL], temperature=0.0)
        assert answer.choices[0].message.content == "It is 21C." and prompts[-1] == _rendered(called)


def test_an_agents_sdk_run():
    """One `Runner.run` tool loop of the OpenAI Agents SDK against the server (skipped where it is not installed)."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    called = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "get_weather", "arguments": ARGS}}]}, {"role": "tool", "content": "21C in Paris"}]

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"21C in {city}"

    async def run(base_url: str) -> tuple[str, str]:
        client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model="tiny", openai_client=client)
        agent = agents.Agent(name="weather", model=model, tools=[get_weather],
                             model_settings=agents.ModelSettings(temperature=0.0))
        config = agents.RunConfig(tracing_disabled=True)
        whole = await agents.Runner.run(agent, "weather?", run_config=config)
        streamed = agents.Runner.run_streamed(agent, "weather?", run_config=config)
        async for _ in streamed.stream_events():
            pass
        return whole.final_output, streamed.final_output

    with _auto((USER, CALL), (called, "It is 21C.")) as srv:
        prompts = _prompts(srv)
        assert asyncio.run(run(srv.base_url)) == ("It is 21C.", "It is 21C.")
        assert len(prompts) == 4 and prompts[1] == prompts[3] == _rendered(called)
