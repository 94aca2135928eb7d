"""Pydantic models for the OpenAI API subset the server speaks: completions, chat completions, their
stream chunks, usage, the model list and the error body.

Requests forbid unknown fields: a field the server does not know is a 400 naming it (OpenAI's
"Unrecognized request argument supplied"); fields it knows but does not honour are declared here and
refused by `serving.check_unsupported` unless they hold their no-op value. The fields they know are
strict (no "2" for 2, no true for 1). Responses carry two dspark
extensions the bench client reads: `usage.spec` (per-request speculative-decoding counts) and
`num_tokens` on each stream-chunk choice (one chunk can carry several tokens when drafts are
accepted).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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


# A field the server knows but honours only at its no-op value (`serving.UNSUPPORTED`): any JSON value
# parses, anything but the no-op is a 400 naming it; left out of the OpenAPI schema.
Refused = SkipJsonSchema[Any]


class _SamplingFields(_Request):
    """Fields shared by both endpoints (OpenAI names plus the vLLM / dspark extensions)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False  # None (JSON null) means the default, as clients send it
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=128)
    speculation: bool | None = True  # dspark: per-request opt-out of speculative decoding
    include_stop_str_in_output: bool | None = False
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) → bias
    min_tokens: int | None = Field(default=None, ge=0)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    user: str | None = None  # an end-user id: accepted, no effect on the output
    # structured output: OpenAI's response_format and vLLM's extras
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    # vLLM's: each prompt token's logprob and the top k at the position before it (not with stream)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # known, refused unless they hold their no-op value (`serving.UNSUPPORTED`)
    use_beam_search: Refused = None
    length_penalty: Refused = None
    logits_processors: Refused = None
    skip_special_tokens: Refused = None
    spaces_between_special_tokens: Refused = None
    truncate_prompt_tokens: Refused = None
    priority: Refused = None
    return_tokens_as_token_ids: Refused = None
    add_special_tokens: Refused = None
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache is automatic
    safety_identifier: str | None = None
    service_tier: Refused = None
    store: Refused = None
    metadata: Refused = None
    # SGLang's, which the routers (vllm-router, sglang-router) send with their defaults on every request they
    # forward: accepted at those values
    no_stop_trim: Refused = None
    return_hidden_states: Refused = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(default=None, ge=0, le=20)  # completions: the top-k count
    echo: bool | None = False
    best_of: Refused = None
    suffix: Refused = None


class ContentPart(_Request):
    type: str = "text"
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ToolCallFunction(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's maximum length
    max_completion_tokens: int | None = None
    logprobs: bool | None = False  # chat: a flag, with top_logprobs the count
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: Refused = None
    separate_reasoning: Refused = None  # SGLang's, sent by the routers with their defaults (above)
    stream_reasoning: Refused = None
    include_reasoning: Refused = None
    echo: bool | None = None
    # known, refused unless they hold their no-op value
    audio: Refused = None
    modalities: Refused = None
    functions: Refused = None
    function_call: Refused = None
    prediction: Refused = None
    reasoning_effort: Refused = None
    verbosity: Refused = None
    web_search_options: Refused = None
    documents: Refused = None


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
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


def _now_s() -> int:
    return int(time.time())


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: Any | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked


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
    content: str | None
    reasoning_content: str | None = None  # vLLM's: a thinking model's reasoning (--reasoning-parser)
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)  # server/tools.py, chat/tool_parsers.py


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
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked
    usage: UsageInfo


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's streamed tool-call entries


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
    root: str | None = None  # the model path
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- tokenizer endpoints (vLLM's /tokenize and /detokenize) ---------------------------------------
class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None  # either a prompt ...
    messages: list[ChatMessage] | None = None  # ... or a conversation (rendered by the chat template)
    add_special_tokens: bool = True  # prompt only
    add_generation_prompt: bool = True  # messages only
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event; `usage` is left out of chunks that carry none, as OpenAI does."""
    exclude = {"usage"} if getattr(chunk, "usage", "absent") is None else None
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"
