"""Pydantic models of a `/v1/responses` request (OpenAI's Responses API), strict as `protocol.py`'s: a field the
server does not know is a 400 naming it; fields it knows but does not honour are declared and refused by
`responses.check_refused` unless they hold their no-op value.

`input` items and `tools` are validated one by one by `server/responses.py` (each kind by its model here), so a bad
item is a 400 naming it (`input[2].call_id`) and a tool of another kind (web_search, file_search, mcp, ...) is
refused as such, not as a mismatch of every member of a union.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dspark.server.protocol import Refused


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Request):
    """A message's text part: `input_text` (the user's, the system's), `output_text` (an earlier answer fed back,
    with the annotations and logprobs the server sent)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Request):
    """`{role, content}`, with or without `type: "message"` (OpenAI's EasyInputMessage and an output message fed
    back, whose id and status are accepted and dropped)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]  # parts checked one by one (`TextPart`)
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(_Request):
    """A call the model made (an output item fed back): it becomes the assistant message's `tool_calls` entry."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    """The result of a call: it becomes a `tool` message answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]  # text, or input_text parts
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Request):
    """A reasoning item fed back: accepted and dropped (the chat path takes no earlier reasoning; chat templates
    of thinking models drop it from earlier turns)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionTool(_Request):
    """A function tool in the Responses shape (flat: not nested under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class JSONSchemaFormat(_Request):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object"} or `JSONSchemaFormat`
    verbosity: Refused = None


class StreamOptions(_Request):
    include_obfuscation: bool | None = None  # accepted: the events carry no obfuscation padding either way


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]  # items checked one by one (`responses.chat_messages`)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools (`FunctionTool`)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # echoed; the tool parser returns the calls the model wrote (vLLM's)
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    seed: int | None = None  # vLLM's extension
    speculation: bool | None = True  # dspark: per-request opt-out of speculative decoding
    text: TextConfig | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None  # echoed
    user: str | None = None  # an end-user id: accepted, no effect on the output
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache is automatic
    safety_identifier: str | None = None
    store: bool | None = None  # accepted, nothing is stored (vLLM's default): the response says store=false
    # known, refused unless they hold their no-op value (`responses.REFUSED`)
    previous_response_id: Refused = None
    conversation: Refused = None
    background: Refused = None
    include: Refused = None
    reasoning: Refused = None
    truncation: Refused = None
    service_tier: Refused = None
    prompt: Refused = None
    max_tool_calls: Refused = None
    top_logprobs: Refused = None
