"""One choice of a response as the server reports it: the engine's text with what the request adds around it
(an echoed prompt, logprobs in the endpoint's shape, vLLM's prompt_logprobs, a thinking model's reasoning
apart from its answer, the answer's tool calls), for a stream chunk by chunk or for a whole response at once
(`serving.stream_response`, `serving.collect_response`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from dspark.server.async_engine import RequestDelta
from dspark.server.logprobs import LogprobFormatter
from dspark.chat.reasoning import ReasoningStream
from dspark.chat.tool_parsers import ToolParser
from dspark.server.tools import ToolMode, openai_tool_call


@dataclass
class Choice:
    index: int
    text: str | None
    finish_reason: str | None = None
    logprobs: dict | None = None
    num_tokens: int = 0
    tool_calls: list[dict] | None = None
    prompt_logprobs: list | None = None  # vLLM's shape (whole responses only)
    reasoning: str | None = None  # chat: reasoning_content (--reasoning-parser)


@dataclass
class Output:
    """What one choice adds around the engine's text: an echoed prompt (with its tokens' logprobs leading
    the choice's when both are asked), logprobs in the endpoint's shape, vLLM's prompt_logprobs."""

    echo: str = ""
    logprobs: LogprobFormatter | None = None
    tool_mode: ToolMode | None = None  # chat with a required tool call: the text becomes tool_calls
    echo_logprobs: bool = False  # the echoed prompt's tokens lead the logprobs (legacy completions)
    first_prompt_id: int = 0  # the prompt's first token (echo_logprobs: its entry has no logprob)
    prompt_logprobs: LogprobFormatter | None = None  # vLLM's prompt_logprobs field, when asked
    score_only: bool = False  # echo with max_tokens 0: the prompt alone, the one generated token dropped
    reasoning: ReasoningStream | None = None  # chat with --reasoning-parser: thoughts apart from the answer
    tool_parser: ToolParser | None = None  # chat with tools and tool_choice "auto": the model's calls parsed
    tool_accept: Callable | None = None  # strict tools: a call whose arguments do not validate stays content
    tools: dict[str, dict] | None = None  # name -> parameters schema: types the values of text formats
    _tool_stream: object = None
    _held: list[str] = field(default_factory=list)  # streamed text held back for the tool call
    _prompt_entries: list | None = None  # the engine's prompt logprobs, from the first delta

    @property
    def echo_first(self) -> str:
        """The echo sent before any token (streams); with echo_logprobs it waits for the prompt's logprobs
        and leads the first delta instead."""
        return "" if self.echo_logprobs else self.echo

    def view(self, delta: RequestDelta) -> RequestDelta:
        """The delta as this choice reports it: the prompt's logprobs taken; score_only drops the output."""
        if delta.prompt_logprobs is not None and self._prompt_entries is None:
            self._prompt_entries = delta.prompt_logprobs
        if self.score_only:
            return dataclasses.replace(delta, text="", num_tokens=0, num_output_tokens=0, logprobs=None,
                                       finish_reason="length" if delta.finish_reason == "stop" else delta.finish_reason)
        return delta

    def lead_text(self, delta: RequestDelta) -> str:
        """The echo that leads this delta's text in a stream (echo_logprobs: with the first delta)."""
        return self.echo if self.echo_logprobs and delta.prompt_logprobs is not None else ""

    def format_logprobs(self, delta: RequestDelta):
        if self.logprobs is None:
            return None
        parts = [self.logprobs.format_prompt(self.first_prompt_id, delta.prompt_logprobs)] if (
            self.echo_logprobs and delta.prompt_logprobs is not None) else []
        parts.append(self.logprobs.format(delta.logprobs or []))
        return LogprobFormatter.merge(parts)

    def vllm_prompt_logprobs(self) -> list | None:
        if self.prompt_logprobs is None or self._prompt_entries is None:
            return None
        return self.prompt_logprobs.vllm_entries(self._prompt_entries)

    def choice(self, index: int, text: str, delta: RequestDelta, logprobs, *, whole: bool = False) -> Choice:
        """One choice of a chunk (text so far in this delta) or of the whole response (`whole`: all the text).
        The reasoning comes off first, then the answer's tool calls."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if delta.finished:
                more_reasoning, more_text = self.reasoning.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if self.tool_parser is not None:
            choice = self._parsed_calls(index, text, delta, logprobs, whole)
        else:
            choice = self._choice(index, text, delta, logprobs)
        choice.reasoning = reasoning or None
        if delta.finished:
            choice.prompt_logprobs = self.vllm_prompt_logprobs()
        return choice

    def _parsed_calls(self, index: int, text: str, delta: RequestDelta, logprobs, whole: bool) -> Choice:
        """tool_choice "auto": the model's calls in OpenAI's shape (whole, or as stream entries); a call
        ends the choice with "tool_calls" where the model stopped by itself."""
        if whole:
            parsed = self.tool_parser.parse(text, accept=self.tool_accept, tools=self.tools)
            calls = [openai_tool_call(c.name, c.arguments) for c in parsed.calls]
            content = parsed.content if calls else text
        else:
            if self._tool_stream is None:
                self._tool_stream = self.tool_parser.stream(self.tools)
                self._tool_stream.accept = self.tool_accept
            step = self._tool_stream.feed(text)
            content, calls = step.content, list(step.tool_calls)
            if delta.finished:
                end = self._tool_stream.finish()
                content, calls = content + end.content, calls + list(end.tool_calls)
        called = bool(calls) if whole else self._tool_stream.has_calls
        reason = "tool_calls" if called and delta.finish_reason == "stop" else delta.finish_reason
        return Choice(index, content, reason, logprobs, delta.num_tokens, tool_calls=calls or None)

    def _choice(self, index: int, text: str, delta: RequestDelta, logprobs) -> Choice:
        if self.tool_mode is None:
            return Choice(index, text, delta.finish_reason, logprobs, delta.num_tokens)
        self._held.append(text)
        if not delta.finished:
            return Choice(index, "", None, logprobs, delta.num_tokens)
        whole = "".join(self._held)
        calls = self.tool_mode.calls(whole) if delta.finish_reason == "stop" else None
        if calls is None:  # cut off (length, abort) or not a call: the text as it is
            return Choice(index, whole, delta.finish_reason, logprobs, delta.num_tokens)
        return Choice(index, None, "tool_calls", logprobs, delta.num_tokens, calls)
