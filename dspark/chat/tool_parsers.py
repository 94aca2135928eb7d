"""Tool-call parsers: a chat model's raw output text -> OpenAI tool calls (`--tool-call-parser NAME`).

Each model family writes its calls in its own syntax; one ToolParser subclass per syntax, registered by
name in TOOL_PARSERS:
* `hermes` (Hermes, Qwen2.5/Qwen3): zero or more
  `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>` blocks, with
  content before, between and after them. The arguments may also be a JSON string holding the object.
  (Qwen3-Coder and Qwen3.5 put XML inside the same markers: that is `qwen3_coder`; hermes keeps such
  blocks as content.)
* `qwen3_coder` (Qwen3-Coder, Qwen3.5): the same `<tool_call>` blocks holding one function each, as
  `<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>`. A value is the
  raw text up to the first `</parameter>`, less one leading and one trailing newline. Qwen's own parser
  converts values by the tool's schema, which a parser does not have here: a value that is JSON other
  than a string (a number, true/false/null, an object, a list) becomes that value; anything else, a
  JSON string literal included, stays the text as written.
* `llama3_json` (Llama 3.1/3.2 JSON tool calling): the whole output, optionally after `<|python_tag|>`,
  is one JSON object `{"name": ..., "parameters": {...}}` ("arguments" accepted too) or several
  separated by `;`.
* `pythonic` (Llama 3.2/4 pythonic): the whole output, optionally wrapped in
  `<|python_start|>`...`<|python_end|>`, is a Python list of calls with keyword arguments that are
  literals: `[get_weather(city="Paris", days=3), get_time()]`. Read with `ast`, never evaluated.
* `gemma4` (Gemma 4): `<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>` blocks;
  keys are bare, strings are delimited by the `<|"|>` token on both sides (and may hold any other
  character), numbers/true/false/null are bare, objects `{}` and lists `[]` nest.

Parsing never raises: a call that does not parse (malformed JSON, a missing end marker, unknown syntax)
stays in the content as the text it was, and the calls that did parse are kept.

Streaming (ToolStream): content is released as soon as it cannot be the start of a call marker (only a
suffix that is a prefix of the marker is held back); a call is held until its end marker (or, for the
whole-output formats, until finish()) and then sent as one delta entry with id, type, name and its
arguments (one entry per call index per delta, as OpenAI and vLLM send). parse() is the stream fed the
whole text in one piece, so both share one implementation (the tests check that every split gives the
same answer). A feed costs in proportion to its own text (plus a marker's length) however much came
before it, and a call is joined and parsed once, when it is complete; parse() is linear in the text
(`dspark/chat/tool_streams.py`). Content: with calls, ParsedOutput.content is the
text outside them, stripped, None when empty; without calls it is the text unchanged (None when empty).
The streamed content pieces concatenate to exactly the text outside the calls (unstripped).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Callable, ClassVar

from dspark.chat.tool_streams import (ParsedCall, ParsedOutput, StreamDelta, ToolStream, attempt,  # noqa: F401
                                      MarkedCallStream, WholeOutputStream)


def _dumps(arguments: dict) -> str:
    # allow_nan=False: NaN/Infinity (which json.loads and Python literals allow) are not JSON; the call
    # then does not parse. ensure_ascii=False: clients get the text as the model wrote it.
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def _arguments_json(value) -> str | None:
    """The arguments as JSON object text: from a dict, or a JSON string holding one; None otherwise."""
    if isinstance(value, str):
        value = json.loads(value)
    return _dumps(value) if isinstance(value, dict) else None


def _call_from_object(obj) -> ParsedCall | None:
    """`{"name": str, "arguments" | "parameters": {...}}` as a call; None for any other shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    if key not in obj:  # a bare {"name": ...} is more likely JSON content than a call
        return None
    arguments = _arguments_json(obj[key])
    return None if arguments is None else ParsedCall(obj["name"], arguments)

class ToolParser:
    """One tool-call syntax. Subclasses name themselves and build their stream."""

    name: ClassVar[str]

    def stream(self) -> ToolStream:
        raise NotImplementedError

    def parse(self, text: str, accept: Callable[[ParsedCall], bool] | None = None) -> ParsedOutput:
        stream = self.stream()
        stream.accept = accept
        content = stream.feed(text).content + stream.finish().content
        if stream.calls:
            content = content.strip()
        return ParsedOutput(content or None, list(stream.calls))


# ---- hermes ----------------------------------------------------------------------------------------

def _hermes_call(body: str) -> ParsedCall | None:
    return _call_from_object(json.loads(body))


class HermesParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolStream:
        return MarkedCallStream("<tool_call>", "</tool_call>", _hermes_call)


# ---- qwen3_coder -----------------------------------------------------------------------------------

_QWEN_FUNCTION = re.compile(r"\s*<function=([^<>\s]+)>")
_QWEN_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]+)>")
_QWEN_PARAMETER_END = "</parameter>"
_QWEN_FUNCTION_END = re.compile(r"\s*</function>\s*")


def _qwen_value(text: str):
    """A parameter's text as a value: JSON when it is JSON other than a string, else the text itself."""
    try:
        value = json.loads(text)
        _dumps(value)  # NaN, Infinity and 1e999 read as floats but are not JSON: keep them as text
    except (ValueError, RecursionError):
        return text
    return text if isinstance(value, str) else value


def _qwen3_coder_call(body: str) -> ParsedCall | None:
    """`<function=NAME>`, then `<parameter=KEY>value</parameter>` blocks, then `</function>`; only
    whitespace between the tags."""
    function = _QWEN_FUNCTION.match(body)
    if function is None:
        return None
    arguments, pos = {}, function.end()
    while (parameter := _QWEN_PARAMETER.match(body, pos)) is not None:
        end = body.find(_QWEN_PARAMETER_END, parameter.end())
        if end < 0:
            return None
        # the template writes each value on lines of its own: drop the newline after the tag and before
        # the end tag, and nothing more, so a value's own blank lines are kept
        text = body[parameter.end():end].removeprefix("\n").removesuffix("\n")
        arguments[parameter.group(1)] = _qwen_value(text)
        pos = end + len(_QWEN_PARAMETER_END)
    if _QWEN_FUNCTION_END.fullmatch(body, pos) is None:  # stray text, an unclosed tag, no </function>
        return None
    return ParsedCall(function.group(1), _dumps(arguments))


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def stream(self) -> ToolStream:
        return MarkedCallStream("<tool_call>", "</tool_call>", _qwen3_coder_call)


# ---- llama3_json -----------------------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"
_BLANK = re.compile(r"\s*")


def _llama3_calls(text: str) -> list[ParsedCall] | None:
    """`{call}` or `{call}; {call}...` (a trailing `;` tolerated). Objects are read one at a time
    rather than split on `;`, which string values may contain."""
    body = text.strip().removeprefix(_PYTHON_TAG)
    decoder = json.JSONDecoder()
    calls, pos = [], _BLANK.match(body).end()
    while pos < len(body):
        obj, pos = decoder.raw_decode(body, pos)
        call = _call_from_object(obj)
        if call is None:
            return None
        calls.append(call)
        pos = _BLANK.match(body, pos).end()
        if pos < len(body):
            if body[pos] != ";":
                return None
            pos = _BLANK.match(body, pos + 1).end()
    return calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolStream:
        return WholeOutputStream(_PYTHON_TAG, "{", _llama3_calls)


# ---- pythonic --------------------------------------------------------------------------------------

_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"


def _pythonic_calls(text: str) -> list[ParsedCall] | None:
    """`[f(a=1), g()]`: a list of plain-name calls with literal keyword arguments only."""
    body = text.strip().removeprefix(_PYTHON_START).strip().removesuffix(_PYTHON_END)
    tree = ast.parse(body.strip(), mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(kw.arg is None for kw in node.keywords):  # **kwargs
            return None
        # literal_eval accepts literals only (no names, calls or attributes); sets, bytes and complex
        # numbers pass it but not json.dumps, so such a call does not parse
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        calls.append(ParsedCall(node.func.id, _dumps(arguments)))
    return calls


class PythonicParser(ToolParser):
    name = "pythonic"

    def stream(self) -> ToolStream:
        return WholeOutputStream(_PYTHON_START, "[", _pythonic_calls)


# ---- gemma4 ----------------------------------------------------------------------------------------

_GEMMA_QUOTE = '<|"|>'
_GEMMA_CALL = re.compile(r"\s*call:([\w.\-]+)\s*(?=\{)")
_GEMMA_KEY = re.compile(r"[^\s:,{}\[\]<]+")
_GEMMA_BARE = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


class _GemmaReader:
    """Reads Gemma 4's argument syntax into Python values; ValueError on anything else."""

    def __init__(self, text: str, pos: int) -> None:
        self.text, self.pos = text, pos

    def skip_blank(self) -> None:
        self.pos = _BLANK.match(self.text, self.pos).end()

    def _take(self, token: str) -> bool:
        self.skip_blank()
        if self.text.startswith(token, self.pos):
            self.pos += len(token)
            return True
        return False

    def _expect(self, token: str) -> None:
        if not self._take(token):
            raise ValueError(f"expected {token!r} at {self.pos}")

    def _string(self) -> str:
        end = self.text.find(_GEMMA_QUOTE, self.pos)
        if end < 0:
            raise ValueError("unterminated string")
        value, self.pos = self.text[self.pos:end], end + len(_GEMMA_QUOTE)
        return value

    def _key(self) -> str:
        if self._take(_GEMMA_QUOTE):
            return self._string()
        match = _GEMMA_KEY.match(self.text, self.pos)
        if match is None:
            raise ValueError(f"expected a key at {self.pos}")
        self.pos = match.end()
        return match.group()

    def value(self):
        if self._take(_GEMMA_QUOTE):
            return self._string()
        if self.text.startswith("{", self.pos):
            return self.object()
        if self.text.startswith("[", self.pos):
            return self._list()
        match = _GEMMA_BARE.match(self.text, self.pos)
        if match is None:
            raise ValueError(f"expected a value at {self.pos}")
        self.pos = match.end()
        return json.loads(match.group())

    def object(self) -> dict:
        self._expect("{")
        out = {}
        if self._take("}"):
            return out
        while True:
            key = self._key()
            self._expect(":")
            out[key] = self.value()
            if self._take("}"):
                return out
            self._expect(",")

    def _list(self) -> list:
        self._expect("[")
        out = []
        if self._take("]"):
            return out
        while True:
            out.append(self.value())
            if self._take("]"):
                return out
            self._expect(",")


def _gemma4_call(body: str) -> ParsedCall | None:
    """`call:NAME{arguments}` and nothing after the closing brace."""
    match = _GEMMA_CALL.match(body)
    if match is None:
        return None
    reader = _GemmaReader(body, match.end())
    arguments = reader.object()
    reader.skip_blank()
    if reader.pos != len(body):
        return None
    return ParsedCall(match.group(1), _dumps(arguments))


class Gemma4Parser(ToolParser):
    name = "gemma4"

    def stream(self) -> ToolStream:
        return MarkedCallStream("<|tool_call>", "<tool_call|>", _gemma4_call)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (HermesParser, Qwen3CoderParser, Llama3JsonParser, PythonicParser, Gemma4Parser)}


def get_tool_parser(name: str) -> ToolParser:
    """A fresh parser for a registry name; ValueError naming the valid ones for any other."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; valid names: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
