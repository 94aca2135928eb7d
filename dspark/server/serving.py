"""Request → (prompt ids, SamplingParams), and engine deltas → OpenAI responses (SSE or whole).

Both endpoints share one path: `sampling_params` and `*_prompt_ids` validate and tokenize (raising
`APIError`, which the app turns into OpenAI's error body), then `stream_response` /
`collect_response` drive one `RequestStream`. The two endpoints differ only in the chunk and
response classes, which `_Shape` bundles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import AsyncIterator, Callable

from dspark.sampling import SamplingParams
from dspark.server.async_engine import RequestDelta, RequestStream
from dspark.server.protocol import (
    AssistantMessage, ChatCompletionChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatStreamChoice, CompletionChoice, CompletionRequest,
    CompletionResponse, CompletionStreamChoice, CompletionStreamResponse, DeltaMessage, ErrorInfo,
    ErrorResponse, PromptTokensDetails, SpecUsage, UsageInfo, sse_event)


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
def sampling_params(req: CompletionRequest | ChatCompletionRequest,
                    max_tokens: int | None) -> SamplingParams:
    if req.n not in (None, 1):
        raise bad_request(f"n={req.n} is not supported; only n=1", param="n")
    stop = req.stop if req.stop is not None else ()
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            max_tokens=max_tokens,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos), seed=req.seed,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            speculation=req.speculation is not False)
    except ValueError as e:  # the message starts with the field's name
        name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=name if name in _PARAM_FIELDS else None) from None


_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}


def completion_prompt_ids(req: CompletionRequest, tokenizer) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"batched prompts not supported (got {len(prompt)}); send one prompt "
                              f"per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return list(prompt)


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            kinds = {part.type for part in content} - {"text"}
            if kinds:
                raise bad_request(f"messages[{i}].content: only text parts are supported, got "
                                  f"{', '.join(sorted(kinds))}", param=f"messages[{i}].content")
            content = "\n".join(part.text or "" for part in content)
        messages.append({"role": m.role, "content": content or ""})
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:
        raise bad_request("this model has no chat template (a base model): send the text to "
                          "/v1/completions, or start the server with --chat-template", param="messages")
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    except Exception as e:  # the template rejects the conversation (role order, unknown role, ...)
        raise bad_request(f"chat template failed on these messages: {e}",
                          param="messages") from None


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


# -- engine output → response ----------------------------------------------------------------------
def usage_of(delta: RequestDelta) -> UsageInfo:
    s = delta.spec
    return UsageInfo(
        prompt_tokens=delta.num_prompt_tokens, completion_tokens=delta.num_output_tokens,
        total_tokens=delta.num_prompt_tokens + delta.num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=delta.num_cached_tokens),
        spec=SpecUsage(num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
                       num_accepted_tokens=s.num_accepted_tokens,
                       acceptance_length=s.acceptance_length))


@dataclass(frozen=True)
class _Shape:
    """How one endpoint spells a chunk and a whole response."""

    chunk: Callable  # (request_id, model, text | None, num_tokens, finish_reason, usage) → model
    response: Callable  # (request_id, model, text, finish_reason, usage) → model
    first_chunk: Callable | None  # (request_id, model) → model sent before any token, or None


def _completion_chunk(rid, model, text, num_tokens, finish_reason, usage):
    choices = [] if text is None else [CompletionStreamChoice(
        text=text, finish_reason=finish_reason, num_tokens=num_tokens)]
    return CompletionStreamResponse(id=rid, model=model, choices=choices, usage=usage)


def _completion_response(rid, model, text, finish_reason, usage):
    return CompletionResponse(id=rid, model=model, usage=usage,
                              choices=[CompletionChoice(text=text, finish_reason=finish_reason)])


def _chat_chunk(rid, model, text, num_tokens, finish_reason, usage):
    choices = [] if text is None else [ChatStreamChoice(
        delta=DeltaMessage(content=text), finish_reason=finish_reason, num_tokens=num_tokens)]
    return ChatCompletionChunk(id=rid, model=model, choices=choices, usage=usage)


def _chat_first_chunk(rid, model):
    return ChatCompletionChunk(id=rid, model=model, choices=[ChatStreamChoice(
        delta=DeltaMessage(role="assistant", content=""))])


def _chat_response(rid, model, text, finish_reason, usage):
    return ChatCompletionResponse(id=rid, model=model, usage=usage, choices=[ChatCompletionChoice(
        message=AssistantMessage(content=text), finish_reason=finish_reason)])


COMPLETION = _Shape(_completion_chunk, _completion_response, None)
CHAT = _Shape(_chat_chunk, _chat_response, _chat_first_chunk)


def _error_event(message: str, status: int = 500) -> str:
    body = APIError(status, message, type="internal_error").body()
    return f"data: {json.dumps(body)}\n\n"


async def stream_response(stream: RequestStream, shape: _Shape, *, model: str,
                          include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """SSE events: [first chunk], one chunk per delta that carries text or tokens, the finishing
    chunk, [a usage-only chunk], then `[DONE]`. The stream is closed (request aborted) if the client
    goes away mid-way."""
    rid = stream.request_id
    last: RequestDelta | None = None
    try:
        if shape.first_chunk is not None:
            yield sse_event(shape.first_chunk(rid, model))
        async for delta in stream:
            last = delta
            if delta.error:
                yield _error_event(delta.error, delta.error_status)
                break
            if delta.text or delta.num_tokens or delta.finished:
                usage = usage_of(delta) if continuous_usage else None
                yield sse_event(shape.chunk(rid, model, delta.text, delta.num_tokens,
                                            delta.finish_reason, usage))
        if include_usage and last is not None and not last.error:
            yield sse_event(shape.chunk(rid, model, None, 0, None, usage_of(last)))
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


async def collect_response(stream: RequestStream, shape: _Shape, *, model: str,
                           is_disconnected: Callable):
    """The whole response once the request finishes; aborts it if the client disconnects."""
    parts: list[str] = []
    try:
        async for delta in stream:
            if delta.error:
                kind = "timeout_error" if delta.error_status == 504 else "internal_error"
                raise APIError(delta.error_status, delta.error, type=kind)
            parts.append(delta.text)
            if delta.finished:
                return shape.response(stream.request_id, model, "".join(parts),
                                      delta.finish_reason, usage_of(delta))
            if await is_disconnected():
                break
        return None
    finally:
        stream.close()
