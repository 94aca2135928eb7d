"""Pydantic models for the OpenAI API subset the server speaks: completions, chat completions, their
stream chunks, usage, the model list and the error body.

Requests ignore unknown fields (clients send many we do not use); the fields they know are strict (no
"2" for 2, no true for 1). Responses carry two dspark
extensions the bench client reads: `usage.spec` (per-request speculative-decoding counts) and
`num_tokens` on each stream-chunk choice (one chunk can carry several tokens when drafts are
accepted).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors ----------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# -- requests --------------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage on every chunk


class _SamplingFields(_Request):
    """Fields shared by both endpoints (OpenAI names plus the vLLM / dspark extensions)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False  # None (JSON null) means the default, as clients send it
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    speculation: bool | None = True  # dspark: per-request opt-out of speculative decoding
    include_stop_str_in_output: bool | None = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions


class ContentPart(_Request):
    type: str = "text"
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's maximum length
    max_completion_tokens: int | None = None


# -- usage -----------------------------------------------------------------------------------------
class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class SpecUsage(_Response):
    """dspark extension: this request's speculative-decoding counts."""

    num_drafts: int = 0  # verification rounds that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_length: float = 1.0  # mean tokens per verification round, bonus included


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    spec: SpecUsage = Field(default_factory=SpecUsage)


# -- completions -----------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "abort"]


def _now_s() -> int:
    return int(time.time())


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: Any | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(_Response):
    index: int = 0
    text: str
    logprobs: Any | None = None
    finish_reason: FinishReason | None = None
    num_tokens: int = 0  # dspark extension: tokens this chunk carries


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


# -- chat completions ------------------------------------------------------------------------------
class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: Any | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: Any | None = None
    finish_reason: FinishReason | None = None
    num_tokens: int = 0  # dspark extension: tokens this chunk carries


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# -- models ----------------------------------------------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now_s)
    owned_by: str = "dspark"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event; `usage` is left out of chunks that carry none, as OpenAI does."""
    exclude = {"usage"} if getattr(chunk, "usage", "absent") is None else None
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"
