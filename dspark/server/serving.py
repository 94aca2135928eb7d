"""Request → (prompt ids, SamplingParams), and engine deltas → OpenAI responses (SSE or whole).

Both endpoints share one path: `sampling_params` and `*_prompt_ids` validate and tokenize (raising
`APIError`, which the app turns into OpenAI's error body), then `stream_response` /
`collect_response` drive one `RequestStream` per choice (n). The two endpoints differ only in the chunk and
response classes, which `_Shape` bundles.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from typing import AsyncIterator, Callable

from dspark.sampling import SamplingParams
from dspark.server.async_engine import RequestDelta, RequestStream
from dspark.server.choices import Choice, Output
from dspark.server.logprobs import LogprobFormatter
from dspark.chat.reasoning import ReasoningFormat
from dspark.server.streams import merged as _merged
from dspark.server.tools import ToolMode, template_tools, tool_constraint
from dspark.server.protocol import (
    AssistantMessage, ChatCompletionChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatStreamChoice, CompletionChoice, CompletionRequest,
    CompletionResponse, CompletionStreamChoice, CompletionStreamResponse, DeltaMessage, ErrorInfo,
    ErrorResponse, PromptTokensDetails, SpecUsage, UsageInfo, sse_event)

log = logging.getLogger("dspark.server")


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.status_code)).model_dump()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# -- request → engine input ------------------------------------------------------------------------
def _is(*values):
    return lambda v: any(type(v) is type(x) and v == x for x in values)


# Fields the server knows but does not honour: refused with a 400 naming the field unless they hold
# a value that asks for nothing (the check's predicate). Everything else in the request models is
# honoured; fields the models do not declare are refused by pydantic (extra="forbid").
UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "use_beam_search": _is(None, False),
    "length_penalty": _is(None, 1.0),
    "logits_processors": _is(None),
    "skip_special_tokens": _is(None, True),
    "spaces_between_special_tokens": _is(None, True),
    "truncate_prompt_tokens": _is(None),
    "priority": _is(None, 0),
    "return_tokens_as_token_ids": _is(None, False),
    "service_tier": _is(None, "auto", "default"),
    "store": _is(None, False),
    "metadata": _is(None),
    "suffix": _is(None, ""),
    "audio": _is(None),
    "modalities": _is(None, ["text"]),
    "functions": _is(None),
    "function_call": _is(None),
    "prediction": _is(None),
    "reasoning_effort": _is(None),
    "verbosity": _is(None),
    "web_search_options": _is(None),
    "documents": _is(None),
    "continue_final_message": _is(None, False),
    # what vllm-router / sglang-router add to every request they forward (SGLang's fields, their defaults)
    "no_stop_trim": _is(None, False),
    "return_hidden_states": _is(None, False),
    "separate_reasoning": _is(None, True),
    "stream_reasoning": _is(None, True),
    "include_reasoning": _is(None, True),
}


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    for name, ok in UNSUPPORTED.items():
        if name in type(req).model_fields and not ok(getattr(req, name)):
            raise bad_request(f"{name}={getattr(req, name)!r} is not supported by this server",
                              param=name)
    if isinstance(req, ChatCompletionRequest) and req.echo:
        raise bad_request("echo is supported on /v1/completions only", param="echo")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
    if isinstance(req, CompletionRequest) and req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 needs echo=true (it scores the prompt without generating)",
                          param="max_tokens")
    if isinstance(req, ChatCompletionRequest) and req.tool_choice not in (None, "none") and not req.tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    if isinstance(req, CompletionRequest) and not (
            req.best_of is None or (type(req.best_of) is int and req.best_of in (1, req.n))):
        raise bad_request(f"best_of={req.best_of} is not supported (only best_of == n)", param="best_of")
    if req.add_special_tokens is not None and req.add_special_tokens != isinstance(req, CompletionRequest):
        raise bad_request(f"add_special_tokens={req.add_special_tokens} is not supported on this endpoint",
                          param="add_special_tokens")


def _logit_bias(req) -> dict[int, float]:
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
    return out


def _bad_words(req, tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each bad word as its token sequence alone and after a space (as it appears mid-text)."""
    words = []
    for word in req.bad_words or ():
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in words:
                words.append(ids)
    return tuple(words)


def requested_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The engine's prompt_logprobs: vLLM's field, and for completions with echo the logprobs count (the
    echoed prompt's tokens carry theirs); the larger where both ask."""
    asked = [k for k in (req.prompt_logprobs, req.logprobs if isinstance(req, CompletionRequest) and req.echo
                         else None) if k is not None]
    return max(asked) if asked else None


def requested_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                    tokenizer=None, *, auto_tools: bool = False,
                    reasoning: ReasoningFormat | None = None, call_start: str = "",
                    kept_special_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The engine's parameters (a completion with echo and max_tokens 0 generates one token, which
    `Output.score_only` drops). `auto_tools`: tool_choice "auto" generates freely (a tool parser reads the
    calls); `reasoning`: a chat's structured output or tool grammar applies after the reasoning, which ends at
    its end tag or at a tool call's marker (`call_start`, `call_marker`); `kept_special_ids`: the parsers' tags
    the detokenizer keeps (`kept_tag_ids`)."""
    check_unsupported(req)
    if isinstance(req, CompletionRequest) and req.echo and max_tokens == 0:
        max_tokens = 1
    structured = structured_request(req, auto_tools=auto_tools)
    tags = None
    if reasoning is not None and structured is not None and isinstance(req, ChatCompletionRequest):
        tags = reasoning.tags(tokenizer, call_start)
    stop = req.stop if req.stop is not None else ()
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            max_tokens=max_tokens,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos), seed=req.seed,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            speculation=req.speculation is not False,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req), min_tokens=req.min_tokens or 0,
            bad_words=_bad_words(req, tokenizer) if tokenizer is not None else (),
            allowed_token_ids=tuple(req.allowed_token_ids or ()),
            logprobs=requested_logprobs(req), prompt_logprobs=requested_prompt_logprobs(req),
            structured_outputs=structured, reasoning_tags=tags, n=1 if req.n is None else req.n,
            kept_special_ids=kept_special_ids)
    except ValueError as e:  # the message starts with the field's name
        name = str(e).split(" ", 1)[0].rstrip(":")
        raise bad_request(str(e), param=name if name in _PARAM_FIELDS else None) from None


_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}


def structured_request(req: CompletionRequest | ChatCompletionRequest, *, auto_tools: bool = False) -> dict | None:
    """The request's structured-output constraint (OpenAI response_format, vLLM structured_outputs or
    guided_*), as `SamplingParams.structured_outputs`; None for free text. At most one may be given."""
    given: dict[str, dict] = {}
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            given["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format json_schema needs json_schema.schema (an object)",
                                  param="response_format")
            given["response_format"] = {"json": schema}
        elif kind not in (None, "text"):
            raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, "
                              f"json_schema)", param="response_format")
    if req.structured_outputs is not None:
        given["structured_outputs"] = dict(req.structured_outputs)
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given[name] = {key: getattr(req, name)}
    if isinstance(req, ChatCompletionRequest):
        tool = tool_constraint(req, bad_request, auto_tools=auto_tools)
        if tool is not None:
            given["tools"] = tool[0]
    if len(given) > 1:
        raise bad_request(f"give one structured-output constraint, got {', '.join(given)}",
                          param=next(iter(given)))
    if not given:
        return None
    name, spec = next(iter(given.items()))
    from dspark.structured import check_spec
    try:
        check_spec(spec)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{name}: {e}", param=name) from None
    return spec


def tool_mode(req: ChatCompletionRequest, *, auto_tools: bool = False) -> ToolMode | None:
    tool = tool_constraint(req, bad_request, auto_tools=auto_tools)
    return None if tool is None else tool[1]


def call_marker(req: ChatCompletionRequest, tool_parser) -> str:
    """The marker that opens a call in the server's tool-call format where this chat may call a tool ("" where
    it may not): opened while the model thinks, it ends the thoughts."""
    if tool_parser is None or not req.tools or req.tool_choice == "none":
        return ""
    return tool_parser.call_start or ""


def parses_tool_calls(req: ChatCompletionRequest, auto_tools: bool) -> bool:
    """Does this chat's output go through the server's tool parser (tools, tool_choice "auto")?"""
    return auto_tools and bool(req.tools) and req.tool_choice in (None, "auto")


MAX_BATCHED_PROMPTS = 256  # prompts in one /v1/completions request (a list of strings or of id lists)


def completion_prompts(req: CompletionRequest, tokenizer) -> list[tuple[list[int], str | None]]:
    """(token ids, the text where the prompt was one) of each prompt of a completions request: one (a string
    or a list of ids), or a batch of them, whose choices come back in prompt order (`index` = prompt * n +
    choice), as OpenAI's and vLLM's (eval harnesses send batches)."""
    prompt = req.prompt
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    if len(batch) > MAX_BATCHED_PROMPTS:
        raise bad_request(f"at most {MAX_BATCHED_PROMPTS} prompts in one request, got {len(batch)}", param="prompt")
    return [(tokenizer.encode(p), p) if isinstance(p, str) else (list(p), None) for p in batch]


def request_template(req: ChatCompletionRequest) -> str | None:
    """The chat template the request itself sends (`chat_template`, or inside `chat_template_kwargs`), if any."""
    if req.chat_template is not None:
        return req.chat_template
    return (req.chat_template_kwargs or {}).get("chat_template")


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer, *, trust_request_template: bool = False) -> list[int]:
    """The chat's prompt ids. A template the request sends is a 400 unless the server trusts request templates;
    then it renders in a child process under a budget (`request_template`: blocks, so call this off the event
    loop when `request_template(req)` is set)."""
    template = request_template(req)
    field = "chat_template" if req.chat_template is not None else "chat_template_kwargs"
    if template is not None and not trust_request_template:
        raise bad_request(f"{field}: a chat template sent with the request is refused unless the server runs "
                          "with --trust-request-chat-template", param=field)
    if template is not None and not isinstance(template, str):
        raise bad_request(f"{field}: the chat template must be a string", param=field)
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            kinds = {part.type for part in content} - {"text"}
            if kinds:
                raise bad_request(f"messages[{i}].content: only text parts are supported, got "
                                  f"{', '.join(sorted(kinds))}", param=f"messages[{i}].content")
            content = "\n".join(part.text or "" for part in content)
        message = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template and template is None:
        raise bad_request("this model has no chat template (a base model): send the text to "
                          "/v1/completions, or start the server with --chat-template", param="messages")
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "chat_template"}
    if req.tools and req.tool_choice != "none":
        kwargs["tools"] = template_tools(req)
    add_generation_prompt = req.add_generation_prompt is not False
    if template is not None:
        from dspark.server.request_template import TemplateBudgetError, render
        inner = getattr(tokenizer, "tokenizer", tokenizer)
        special = {k: v for k, v in (getattr(inner, "special_tokens_map", None) or {}).items() if isinstance(v, str)}
        try:
            text = render(template, messages, special=special, add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateBudgetError as e:
            raise bad_request(f"{field}: {e}", param=field) from None
        return list(tokenizer.encode(text, add_special_tokens=False))
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs))
    except TypeError as e:
        raise bad_request(f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
    except Exception as e:  # the template rejects the conversation (role order, unknown role, ...)
        raise bad_request(f"chat template failed on these messages: {e}",
                          param="messages") from None


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


# -- engine output → response ----------------------------------------------------------------------
def usage_of(*deltas: RequestDelta, choices_per_prompt: int | None = None) -> UsageInfo:
    """Usage of one request, or of its choices in index order: each prompt counted once (the choices of one
    prompt are `choices_per_prompt` consecutive deltas; None: they all share one)."""
    firsts = deltas[::choices_per_prompt or len(deltas)]
    prompt = sum(d.num_prompt_tokens for d in firsts)
    num_drafts = sum(d.spec.num_drafts for d in deltas)
    accepted = sum(d.spec.num_accepted_tokens for d in deltas)
    completion = sum(d.num_output_tokens for d in deltas)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(d.num_cached_tokens for d in firsts)),
        spec=SpecUsage(num_drafts=num_drafts, num_draft_tokens=sum(d.spec.num_draft_tokens for d in deltas),
                       num_accepted_tokens=accepted,
                       acceptance_length=1.0 + accepted / num_drafts if num_drafts else 1.0))


@dataclass(frozen=True)
class _Shape:
    """How one endpoint spells a chunk and a whole response."""

    chunk: Callable  # (request_id, model, Choice | None, usage) → model
    response: Callable  # (request_id, model, list[Choice], usage) → model
    first_chunk: Callable | None  # (request_id, model, index) → model sent before any token, or None


def _completion_chunk(rid, model, c: Choice | None, usage):
    choices = [] if c is None else [CompletionStreamChoice(
        index=c.index, text=c.text, finish_reason=c.finish_reason, num_tokens=c.num_tokens,
        logprobs=c.logprobs)]
    return CompletionStreamResponse(id=rid, model=model, choices=choices, usage=usage)


def _completion_response(rid, model, choices: list[Choice], usage):
    return CompletionResponse(id=rid, model=model, usage=usage, choices=[CompletionChoice(
        index=c.index, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs,
        prompt_logprobs=c.prompt_logprobs) for c in choices])


def _chat_chunk(rid, model, c: Choice | None, usage):
    choices = [] if c is None else [ChatStreamChoice(
        index=c.index, delta=DeltaMessage(content=c.text, reasoning_content=c.reasoning, tool_calls=c.tool_calls),
        finish_reason=c.finish_reason, num_tokens=c.num_tokens, logprobs=c.logprobs)]
    return ChatCompletionChunk(id=rid, model=model, choices=choices, usage=usage)


def _chat_first_chunk(rid, model, index):
    return ChatCompletionChunk(id=rid, model=model, choices=[ChatStreamChoice(
        index=index, delta=DeltaMessage(role="assistant", content=""))])


def _chat_response(rid, model, choices: list[Choice], usage):
    return ChatCompletionResponse(id=rid, model=model, usage=usage, choices=[ChatCompletionChoice(
        index=c.index, message=AssistantMessage(content=c.text, reasoning_content=c.reasoning,
                                                tool_calls=c.tool_calls or []),
        finish_reason=c.finish_reason,
        logprobs=c.logprobs) for c in choices], prompt_logprobs=choices[0].prompt_logprobs if choices else None)


COMPLETION = _Shape(_completion_chunk, _completion_response, None)
CHAT = _Shape(_chat_chunk, _chat_response, _chat_first_chunk)


def error_type(status: int) -> str:
    """OpenAI's error type of a request that failed while it ran: past its deadline, refused by its own
    constraints, or a fault of the model or engine."""
    return "timeout_error" if status == 504 else "invalid_request_error" if status < 500 else "internal_error"


def _error_event(message: str, status: int = 500) -> str:
    body = APIError(status, message, type=error_type(status)).body()
    return f"data: {json.dumps(body)}\n\n"


async def stream_response(streams: list[RequestStream], shape: _Shape, *, model: str,
                          include_usage: bool, continuous_usage: bool,
                          outputs: list[Output] | None = None,
                          choices_per_prompt: int | None = None) -> AsyncIterator[str]:
    """SSE events: per choice [first chunk] and [the echoed prompt], one chunk per delta that carries
    text or tokens, the finishing chunk; then [a usage-only chunk] and `[DONE]`. The streams are closed
    (requests aborted) if the client goes away mid-way."""
    outputs = outputs or [Output() for _ in streams]
    rid = streams[0].request_id
    last: dict[int, RequestDelta] = {}
    try:
        for i, out in enumerate(outputs):
            if shape.first_chunk is not None:
                yield sse_event(shape.first_chunk(rid, model, i))
            if out.echo_first:
                yield sse_event(shape.chunk(rid, model, Choice(i, out.echo_first), None))
        async for i, delta in _merged(streams):
            delta = outputs[i].view(delta)
            last[i] = delta
            if delta.error:
                yield _error_event(delta.error, delta.error_status)
                break
            text = outputs[i].lead_text(delta) + delta.text
            if text or delta.num_tokens or delta.finished:
                usage = usage_of(delta) if continuous_usage else None
                choice = outputs[i].choice(i, text, delta, outputs[i].format_logprobs(delta))
                yield sse_event(shape.chunk(rid, model, choice, usage))
        if include_usage and last and not any(d.error for d in last.values()):
            yield sse_event(shape.chunk(rid, model, None, usage_of(*(last[i] for i in sorted(last)),
                                                                   choices_per_prompt=choices_per_prompt)))
        yield "data: [DONE]\n\n"
    except Exception as e:  # a fault building a chunk: the client gets an error event, not a cut-off body
        log.exception("streaming %s failed", rid)
        yield _error_event(f"internal error serving this request: {type(e).__name__}: {e}")
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            s.close()


async def collect_response(streams: list[RequestStream], shape: _Shape, *, model: str,
                           is_disconnected: Callable, outputs: list[Output] | None = None,
                           choices_per_prompt: int | None = None):
    """The whole response once every choice finishes; aborts them if the client disconnects (seen
    between deltas; the app also watches on its own: `disconnect.unless_disconnected`)."""
    outputs = outputs or [Output() for _ in streams]
    parts: list[list[str]] = [[out.echo] for out in outputs]
    logprobs: list[list] = [[] for _ in outputs]
    final: dict[int, RequestDelta] = {}
    try:
        async for i, delta in _merged(streams):
            delta = outputs[i].view(delta)
            if delta.error:
                kind = error_type(delta.error_status)
                raise APIError(delta.error_status, delta.error, type=kind)
            parts[i].append(delta.text)
            logprobs[i].append(outputs[i].format_logprobs(delta))
            if delta.finished:
                final[i] = delta
                if len(final) == len(streams):
                    choices = [outputs[j].choice(j, "".join(parts[j]), final[j], LogprobFormatter.merge(logprobs[j]),
                                                 whole=True) for j in range(len(streams))]
                    return shape.response(streams[0].request_id, model, choices,
                                          usage_of(*(final[j] for j in range(len(streams))),
                                                   choices_per_prompt=choices_per_prompt))
            elif await is_disconnected():
                break
        return None
    finally:
        for s in streams:
            s.close()
