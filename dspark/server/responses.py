"""`/v1/responses`: OpenAI's Responses API served over the chat path, as vLLM serves it.

Request → chat. `chat_request` turns a `ResponsesRequest` into the `ChatCompletionRequest` the chat route starts
(`app.chat_streams`), so prompt rendering, sampling defaults, the tool parser (`--tool-call-parser`), the reasoning
parser (`--reasoning-parser`), structured output and speculation are the chat route's, unchanged:
  instructions          → a system message first
  a string input        → one user message
  message items         → messages (role developer → system; text parts joined as chat joins them)
  function_call items   → the `tool_calls` of an assistant message (calls that follow an assistant message, or each
                          other, join it: one turn, as the model wrote it)
  function_call_output  → a `tool` message answering call_id
  reasoning items       → accepted and dropped (the chat path takes no earlier reasoning; the chat templates of
                          thinking models drop it from earlier turns)
  tools (flat function) → chat tools; tool_choice {type: function, name} → chat's named function
  text.format           → response_format (json_schema, json_object, text)
  max_output_tokens     → max_completion_tokens
An error the chat path raises names the Responses field (`responses_fields`).

Output → response. The choice `choices.Output` reports (reasoning split off, then tool calls) becomes the output
items: a `reasoning` item (summary [], content [reasoning_text]), a `message` item (one output_text part; none for
blank text), a `function_call` item per call. Status `completed`; `incomplete` (reason max_output_tokens) where the
output was cut at the token limit; `cancelled` where the engine aborted it. Usage in the Responses shape
(reasoning_tokens: the reasoning text's token count) with dspark's `spec`. Streamed, the events are typed SSE
(`event: TYPE`, `data: JSON`, a `sequence_number` each) in OpenAI's order: response.created, response.in_progress;
per item output_item.added, then content_part.added, output_text (or reasoning_text) deltas, their .done and
content_part.done, or function_call_arguments.delta/.done; output_item.done; last response.completed (or
response.incomplete, or response.failed on an error). There is no [DONE] line (OpenAI sends none).

Refused (a 400 naming the field; see `REFUSED`): nothing is stored, so `store` is accepted and the response says
store=false (vLLM's default: OpenAI's default is true and clients send it), while previous_response_id,
conversation and background (which need a store) are refused; so are include values (none is produced),
reasoning settings, truncation "auto", stored prompts, max_tool_calls, top_logprobs, text.verbosity, tools other
than functions and input items other than the four above.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from dspark.server.choices import Choice, Output
from dspark.server.disconnect import unless_disconnected
from dspark.server.protocol import ChatCompletionRequest, UsageInfo
from dspark.server.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, FunctionTool,
                                              JSONSchemaFormat, MessageItem, ReasoningItem, ResponsesRequest,
                                              TextPart)
from dspark.server.serving import APIError, bad_request, collect_response, error_type, usage_of

log = logging.getLogger("dspark.server")


def _no_op(*values) -> Callable[[object], bool]:
    return lambda v: any(type(v) is type(x) and v == x for x in values)


def _unset_reasoning(v) -> bool:
    return v is None or isinstance(v, dict) and all(x is None for x in v.values())


# field → (does its value ask for nothing?, why anything else is refused)
REFUSED: dict[str, tuple[Callable[[object], bool], str]] = {
    "previous_response_id": (_no_op(None), "no response is stored here: send the whole conversation as input"),
    "conversation": (_no_op(None), "no conversation is stored here: send the whole conversation as input"),
    "background": (_no_op(None, False), "background responses need a response store, which this server does not keep"),
    "include": (_no_op(None, []), "this server adds none of the extra output include asks for"),
    "reasoning": (_unset_reasoning, "reasoning settings are not supported (the model reasons as its chat template "
                                    "and --reasoning-parser say)"),
    "truncation": (_no_op(None, "disabled"), "a prompt past the model's length is refused, not truncated"),
    "service_tier": (_no_op(None, "auto", "default"), "only the default service tier is served"),
    "prompt": (_no_op(None), "stored prompt templates are not supported"),
    "max_tool_calls": (_no_op(None), "max_tool_calls is not supported"),
    "top_logprobs": (_no_op(None, 0), "logprobs are not returned on /v1/responses"),
}


def check_refused(req: ResponsesRequest) -> None:
    for name, (ok, why) in REFUSED.items():
        if not ok(getattr(req, name)):
            raise bad_request(f"{name}={getattr(req, name)!r} is not supported by this server: {why}", param=name)
    if req.text is not None and req.text.verbosity is not None:
        raise bad_request("text.verbosity is not supported by this server", param="text.verbosity")


# -- request → chat --------------------------------------------------------------------------------------------
def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request the Responses request asks for (400s naming the Responses field)."""
    check_refused(req)
    messages = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    messages += chat_messages(req.input)
    fields = {"model": req.model, "messages": messages, "temperature": req.temperature, "top_p": req.top_p,
              "top_k": req.top_k, "seed": req.seed, "speculation": req.speculation,
              "max_completion_tokens": req.max_output_tokens, "stream": req.stream, "user": req.user,
              "tools": [chat_tool(i, t) for i, t in enumerate(req.tools or ())] or None,
              "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
              "response_format": response_format(req), "prompt_cache_key": req.prompt_cache_key,
              "safety_identifier": req.safety_identifier}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # no message at all (an empty input list, no instructions)
        raise bad_request(f"input: {e.errors()[0]['msg']}", param="input") from None


def chat_messages(items: str | list[dict]) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, raw in enumerate(items):
        kind, where = raw.get("type", "message"), f"input[{i}]"
        if kind == "message":
            item = _checked(MessageItem, raw, where)
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": _text(item.content, f"{where}.content")})
        elif kind == "function_call":
            item = _checked(FunctionCallItem, raw, where)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            item = _checked(FunctionCallOutputItem, raw, where)
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"{where}.output")})
        elif kind == "reasoning":
            _checked(ReasoningItem, raw, where)  # accepted, dropped
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output, reasoning)", param=f"{where}.type")
    return messages


def _text(content: str | list[dict], where: str) -> str:
    """A message's text: the string, or its text parts joined by newlines (as the chat path joins parts)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in ("input_text", "output_text"):
            raise bad_request(f"{where}[{j}]: only text parts are supported, got {part.get('type')!r}",
                              param=f"{where}[{j}].type")
        texts.append(_checked(TextPart, part, f"{where}[{j}]").text)
    return "\n".join(texts)


def _checked(model, raw: dict, where: str):
    """`raw` validated by `model`; a 400 naming the field (`input[2].call_id`) otherwise."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join([where, *(str(p) for p in err["loc"])])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {field}", param=field) from None
        if err["type"] == "missing":
            raise bad_request(f"missing required field {field!r}", param=field) from None
        raise bad_request(f"invalid value for {field!r}: {err['msg']}", param=field) from None


def chat_tool(i: int, raw: dict) -> dict:
    if raw.get("type") != "function":
        raise bad_request(f"tools[{i}]: tools of type {raw.get('type')!r} are not supported (function tools only)",
                          param=f"tools[{i}].type")
    tool = _checked(FunctionTool, raw, f"tools[{i}]")
    return {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):  # "auto", "none", "required": the chat path checks them
        return choice
    if choice.get("type") == "function" and set(choice) == {"type", "name"} and isinstance(choice["name"], str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice {choice!r} is not supported: 'auto', 'none', 'required' or "
                      "{'type': 'function', 'name': NAME}", param="tool_choice")


def response_format(req: ResponsesRequest) -> dict | None:
    fmt = None if req.text is None else req.text.format
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return {"type": kind}
    if kind == "json_schema":
        spec = _checked(JSONSchemaFormat, fmt, "text.format")
        schema = {"name": spec.name, "schema": spec.schema_}
        if spec.strict is not None:
            schema["strict"] = spec.strict
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format {fmt!r} is not supported: type text, json_object or json_schema",
                      param="text.format")


_CHAT_FIELDS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens",
                "max_completion_tokens": "max_output_tokens"}


@contextlib.contextmanager
def responses_fields():
    """An `APIError` raised inside names the Responses field its chat field comes from (`tools[0].function.name`
    → `tools[0].name`, `response_format` → `text.format`, `messages[2]` → `input`)."""
    try:
        yield
    except APIError as e:
        if e.param:
            tool = re.fullmatch(r"(tools\[\d+\])\.function\.(\w+)", e.param)
            head = re.split(r"[.\[]", e.param, maxsplit=1)[0]
            e.param = f"{tool[1]}.{tool[2]}" if tool else _CHAT_FIELDS.get(head, e.param)
        raise


# -- output → response -----------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish_reason: str | None) -> tuple[str, dict | None]:
    """(response status, incomplete_details) of the output's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict) -> dict:
    """A function_call item of one chat tool call (`tools.openai_tool_call`'s shape; a stream entry has an index
    too); its id follows the call id."""
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


@dataclass
class _Builder:
    """The response object of one request, in any of its states."""

    req: ResponsesRequest
    params: object  # the request's SamplingParams (the effective temperature and top_p are echoed)
    rid: str
    model: str
    tokenizer: object
    created_at: int

    def response(self, status: str = "in_progress", output: list | None = None, usage: dict | None = None,
                 incomplete: dict | None = None, error: dict | None = None) -> dict:
        req = self.req
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "model": self.model,
            "output": output or [], "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "prompt_cache_key": req.prompt_cache_key, "reasoning": None,
            "safety_identifier": req.safety_identifier, "service_tier": "default", "store": False,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": req.text.format if req.text is not None and req.text.format else {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_logprobs": 0, "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}}

    def usage(self, usage: UsageInfo, reasoning: str) -> dict:
        thoughts = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {"input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": min(thoughts, usage.completion_tokens)},
                "total_tokens": usage.total_tokens, "spec": usage.spec.model_dump()}

    def whole(self, choice: Choice, usage: UsageInfo) -> dict:
        """The finished response of the whole output's choice."""
        status, incomplete = _status(choice.finish_reason)
        items = [reasoning_item(_id("rs"), choice.reasoning, "completed")] if choice.reasoning else []
        if choice.text and choice.text.strip():
            items.append(message_item(_id("msg"), choice.text, "completed"))
        items += [call_item(call) for call in choice.tool_calls or ()]
        if status == "incomplete" and items and items[-1]["type"] != "function_call":  # the item cut off
            items[-1]["status"] = "incomplete"
        return self.response(status, items, self.usage(usage, choice.reasoning or ""), incomplete)


@dataclass(frozen=True)
class _Whole:
    """What `serving.collect_response` takes of an endpoint's shape: the whole response of its choices."""

    response: Callable


async def respond(request: Request, req: ResponsesRequest, params, stream, output: Output, *, model: str,
                  tokenizer) -> Response:
    """The response to a started request: whole, or (`stream`) as typed SSE events."""
    build = _Builder(req, params, "resp_" + stream.request_id.removeprefix("resp-"), model, tokenizer,
                     int(time.time()))
    if req.stream:
        return StreamingResponse(_Events(build).stream(stream, output), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    whole = _Whole(lambda rid, model, choices, usage: build.whole(choices[0], usage))
    result = await unless_disconnected(collect_response(
        [stream], whole, model=model, is_disconnected=request.is_disconnected, outputs=[output]),
        request.is_disconnected)
    return Response(status_code=499) if result is None else JSONResponse(result)


class _Events:
    """The typed events of one streamed response, numbered in order. One item is open at a time (reasoning or a
    message, whose text arrives in deltas); a function call comes whole (the parser releases each call complete);
    text of another kind, or a call, closes the open item. Blank message text is held until text follows it (a
    message of blanks alone is no item, as in a whole response)."""

    def __init__(self, build: _Builder):
        self.build = build
        self.sequence = 0
        self.items: list[dict] = []  # the closed items
        self.open: dict | None = None  # the open item: its kind, id, text
        self.blank = ""  # message blanks held
        self.reasoning = ""

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def stream(self, stream, output: Output) -> AsyncIterator[str]:
        build = self.build
        try:
            yield self.event("response.created", response=build.response())
            yield self.event("response.in_progress", response=build.response())
            async for delta in stream:
                delta = output.view(delta)
                if delta.error:
                    yield self.failed(delta.error, delta.error_status)
                    return
                if delta.text or delta.finished:
                    for event in self.choice(output.choice(0, delta.text, delta, None)):
                        yield event
                if delta.finished:
                    status, incomplete = _status(delta.finish_reason)
                    for event in self.close("incomplete" if status == "incomplete" else "completed"):
                        yield event
                    done = build.response(status, self.items, build.usage(usage_of(delta), self.reasoning),
                                          incomplete)
                    yield self.event("response.completed" if status == "completed" else "response.incomplete",
                                     response=done)
        except Exception as e:  # a fault building an event: the client gets response.failed, not a cut-off body
            log.exception("streaming %s failed", build.rid)
            yield self.failed(f"internal error serving this request: {type(e).__name__}: {e}", 500)
        finally:
            stream.close()

    def failed(self, message: str, status: int) -> str:
        code = "server_error" if error_type(status) != "invalid_request_error" else "invalid_prompt"
        return self.event("response.failed", response=self.build.response(
            "failed", self.items, error={"code": code, "message": message}))

    def choice(self, choice: Choice) -> list[str]:
        events = []
        if choice.reasoning:
            self.reasoning += choice.reasoning
            events += self.text("reasoning", choice.reasoning)
        if choice.text:
            events += self.text("message", choice.text)
        for call in choice.tool_calls or ():
            events += self.close() + self.call(call)
        return events

    def text(self, kind: str, piece: str) -> list[str]:
        events = []
        if self.open is None or self.open["kind"] != kind:
            if kind == "message" and not (self.blank + piece).strip():
                self.blank += piece
                return []
            events += self.close() + self.start(kind)
        if kind == "message":
            piece, self.blank = self.blank + piece, ""
        self.open["text"] += piece
        item_id, index = self.open["id"], len(self.items)
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(delta, item_id=item_id, output_index=index, content_index=0, delta=piece, **extra)]

    def start(self, kind: str) -> list[str]:
        item_id = _id("msg" if kind == "message" else "rs")
        self.open = {"kind": kind, "id": item_id, "text": ""}
        index = len(self.items)
        if kind == "message":
            item = {**message_item(item_id, "", "in_progress"), "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {**reasoning_item(item_id, "", "in_progress"), "content": []}
            part = {"type": "reasoning_text", "text": ""}
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                           part=part)]

    def close(self, status: str = "completed") -> list[str]:
        """The open item's done events (none open: none)."""
        if self.open is None:
            return []
        kind, item_id, text = self.open["kind"], self.open["id"], self.open["text"]
        index, self.open = len(self.items), None
        if kind == "message":
            item = message_item(item_id, text, status)
            done = self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                              text=text, logprobs=[])
        else:
            item = reasoning_item(item_id, text, status)
            done = self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                              text=text)
        self.items.append(item)
        return [done, self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                                 part=item["content"][0]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, call: dict) -> list[str]:
        item, index = call_item(call), len(self.items)
        self.items.append(item)
        fields = {"item_id": item["id"], "output_index": index}
        return [self.event("response.output_item.added", output_index=index,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", delta=item["arguments"], **fields),
                self.event("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"],
                           **fields),
                self.event("response.output_item.done", output_index=index, item=item)]
