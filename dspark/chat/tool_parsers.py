"""Tool-call parsers: a chat model's raw output text -> OpenAI tool calls (`--tool-call-parser NAME`).

Each model family writes its calls in its own syntax; one ToolParser subclass per syntax, registered by
name in TOOL_PARSERS:
* `hermes` (Hermes, Qwen2.5/Qwen3): zero or more
  `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>` blocks, with
  content before, between and after them. The arguments may also be a JSON string holding the object.
  (Qwen3-Coder and Qwen3.5 put XML inside the same markers: that is `qwen3_coder`; hermes keeps such
  blocks as content.)
* `qwen3_coder` (Qwen3-Coder, Qwen3.5): the same `<tool_call>` blocks holding one function each, as
  `<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>`. A value is the raw text
  between its tag and the `</parameter>` that ends it, less one leading and one trailing newline: the first
  `</parameter>` followed by another parameter tag the tool admits (not given yet) or by `</function>`, so file
  content holding `</parameter>`, `<parameter=` or `</tool_call>` stays one value; a left-out `</parameter>`
  ends the value before the next tag on a line of its own. Values are typed by the request's tool schema as
  Qwen's own parser does (`chat/arguments.py`: a `string` parameter stays text, an undeclared one too); with
  no tools to read, a value that is JSON other than a string becomes that value.
* `llama3_json` (Llama 3.1/3.2 JSON tool calling): the output, optionally after `<|python_tag|>`, starts
  with one JSON object `{"name": ..., "parameters": {...}}` ("arguments" accepted too) or several separated
  by `;` or by newlines; text after the calls is content.
* `pythonic` (Llama 3.2/4 pythonic): the whole output, optionally wrapped in
  `<|python_start|>`...`<|python_end|>`, is a Python list of calls with keyword arguments that are
  literals: `[get_weather(city="Paris", days=3), get_time()]`. Read with `ast`, never evaluated.
* `gemma4` (Gemma 4): `<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>` blocks;
  keys are bare, strings are delimited by the `<|"|>` token on both sides (and may hold any other
  character), numbers/true/false/null are bare, objects `{}` and lists `[]` nest; top-level values are
  re-read by the tool's schema (a string written for an integer parameter).

Parsing never raises: a call that does not parse (malformed JSON, unknown syntax, cut short inside) stays in
the content as the text it was, and the calls that did parse are kept. A complete call whose end marker never
came (EOS or a stop string right after it) is a call. An end marker closes a call only where the call can end
there (after the JSON object's `}`, after `</function>`); one inside a value is part of the value.

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
import functools
import json
import re
from typing import Callable, ClassVar

from dspark.chat.arguments import parameter_schemas, retyped, typed_value
from dspark.chat.tool_streams import (ParsedCall, ParsedOutput, StreamDelta, ToolStream, attempt,  # noqa: F401
                                      MarkedCallStream, WholeOutputStream)


_BLANK = re.compile(r"\s*")


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
    """One tool-call syntax. Subclasses name themselves and build their stream; `tools` (name -> the tool's
    parameters schema, the request's) types the values of the formats that write them as text."""

    name: ClassVar[str]
    call_start: ClassVar[str | None] = None  # the marker that opens a call (it also ends a model's thoughts)
    tags: ClassVar[tuple[str, ...]] = ()  # every marker the format writes (decoded even where special)

    def stream(self, tools: dict[str, dict] | None = None) -> ToolStream:
        raise NotImplementedError

    def parse(self, text: str, accept: Callable[[ParsedCall], bool] | None = None,
              tools: dict[str, dict] | None = None) -> ParsedOutput:
        stream = self.stream(tools)
        stream.accept = accept
        content = stream.feed(text).content + stream.finish().content
        if stream.calls:
            content = content.strip()
        return ParsedOutput(content or None, list(stream.calls))


# ---- hermes ----------------------------------------------------------------------------------------

def _hermes_call(body: str) -> ParsedCall | None:
    return _call_from_object(json.loads(body))


_OBJECT_END = re.compile(r"\}\s*\Z")


class HermesParser(ToolParser):
    name = "hermes"
    tags = ("<tool_call>", "</tool_call>")
    call_start = "<tool_call>"

    def stream(self, tools: dict[str, dict] | None = None) -> ToolStream:
        return MarkedCallStream("<tool_call>", "</tool_call>", _hermes_call,
                                closes=lambda tail: _OBJECT_END.search(tail) is not None)


# ---- qwen3_coder -----------------------------------------------------------------------------------

_QWEN_FUNCTION = re.compile(r"\s*<function=([^<>\s]+)>")
_QWEN_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]+)>")
_QWEN_NEXT_PARAMETER = re.compile(r"\n\s*<parameter=([^<>\n]+)>")
_QWEN_PARAMETER_END = "</parameter>"
_QWEN_FUNCTION_END = re.compile(r"</function>\s*\Z")


def _qwen_value_end(region: str, pos: int, is_next: Callable[[str], bool], is_missing: Callable[[str], bool]
                    ) -> tuple[int, int]:
    """(end of the value that starts at region[pos], where the next tag starts). A value may hold any markup,
    `</parameter>` and `<parameter=` included: it ends at the first `</parameter>` followed, after blanks, by
    the region's end or a parameter tag the call may still have (`is_next`), unless a tag of a required
    parameter not given yet (`is_missing`) stands on a line of its own before it (its `</parameter>` was left
    out); without such an end, before the next `is_next` tag on a line of its own; else at the region's end."""
    end = region.find(_QWEN_PARAMETER_END, pos)
    while end >= 0:
        after = _BLANK.match(region, end + len(_QWEN_PARAMETER_END)).end()
        tag = _QWEN_PARAMETER.match(region, after)
        if after == len(region) or (tag is not None and is_next(tag.group(1))):
            for tag in _QWEN_NEXT_PARAMETER.finditer(region, pos, end):
                if is_missing(tag.group(1)):
                    return tag.start(), tag.start()
            return end, after
        end = region.find(_QWEN_PARAMETER_END, end + 1)
    for tag in _QWEN_NEXT_PARAMETER.finditer(region, pos):
        if is_next(tag.group(1)):
            return tag.start(), tag.start()
    return len(region), len(region)


def _qwen3_coder_call(body: str, tools: dict[str, dict] | None = None) -> ParsedCall | None:
    """`<function=NAME>`, then `<parameter=KEY>value</parameter>` blocks, then `</function>`; only blanks
    between the tags. Values are typed by the tool's declared parameters (`chat/arguments.py`)."""
    function, close = _QWEN_FUNCTION.match(body), _QWEN_FUNCTION_END.search(body)
    if function is None or close is None or close.start() < function.end():
        return None
    name, region = function.group(1), body[function.end():close.start()]
    declared, params, arguments = parameter_schemas(tools, name), (tools or {}).get(name) or {}, {}
    required = set(params.get("required") or ()) if declared else set()
    closed = declared is not None and params.get("additionalProperties", True) is False

    def is_next(key: str) -> bool:  # a tag for a parameter not given yet that the tool admits
        return key not in arguments and (not closed or key in declared)

    def is_missing(key: str) -> bool:
        return key in required and key not in arguments

    pos = _BLANK.match(region).end()
    while pos < len(region):
        parameter = _QWEN_PARAMETER.match(region, pos)
        if parameter is None or parameter.group(1) in arguments:  # stray text, or a key given twice
            return None
        key = parameter.group(1)
        arguments[key] = None  # taken: a later tag with this key is part of a value
        end, pos = _qwen_value_end(region, parameter.end(), is_next, is_missing)
        # the template writes each value on lines of its own: drop the newline after the tag and before the
        # end tag, and nothing more, so a value's own blank lines are kept
        text = region[parameter.end():end].removeprefix("\n").removesuffix("\n")
        # no tools to read types from: a value is JSON where it is JSON other than a string; with tools, a
        # parameter the tool does not declare stays text
        schema = {} if tools is None else (declared or {}).get(key)
        arguments[key] = typed_value(text, schema, params)
    return ParsedCall(name, _dumps(arguments))


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    tags = ("<tool_call>", "</tool_call>")
    call_start = "<tool_call>"

    def stream(self, tools: dict[str, dict] | None = None) -> ToolStream:
        return MarkedCallStream("<tool_call>", "</tool_call>", functools.partial(_qwen3_coder_call, tools=tools),
                                closes=lambda tail: _QWEN_FUNCTION_END.search(tail) is not None)


# ---- llama3_json -----------------------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"


def _llama3_calls(text: str) -> tuple[list[ParsedCall], str] | None:
    """`{call}` or several, each after a `;` or only blanks (newlines), then maybe text: (the calls, the text
    after them). Objects are read one at a time rather than split on `;`, which string values may contain; the
    first object that is not a call, or text that is not an object, ends the calls."""
    body = text.strip().removeprefix(_PYTHON_TAG)
    decoder = json.JSONDecoder()
    calls, pos = [], _BLANK.match(body).end()
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            if not calls:
                raise
            break
        call = _call_from_object(obj)
        if call is None:
            if not calls:
                return None
            break
        calls.append(call)
        pos = _BLANK.match(body, end).end()
        if body.startswith(";", pos):
            pos = _BLANK.match(body, pos + 1).end()
    return calls, body[pos:]


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tags = (_PYTHON_TAG,)

    def stream(self, tools: dict[str, dict] | None = None) -> ToolStream:
        return WholeOutputStream(_PYTHON_TAG, "{", _llama3_calls)


# ---- pythonic --------------------------------------------------------------------------------------

_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"


def _pythonic_calls(text: str) -> tuple[list[ParsedCall], str] | None:
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
    return calls, ""


class PythonicParser(ToolParser):
    name = "pythonic"
    tags = (_PYTHON_START, _PYTHON_END)

    def stream(self, tools: dict[str, dict] | None = None) -> ToolStream:
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


def _gemma4_call(body: str, tools: dict[str, dict] | None = None) -> ParsedCall | None:
    """`call:NAME{arguments}` and nothing after the closing brace; the top-level values re-read by the tool's
    declared parameters (a number written as a string for a number parameter, `chat/arguments.py`)."""
    match = _GEMMA_CALL.match(body)
    if match is None:
        return None
    reader = _GemmaReader(body, match.end())
    arguments = reader.object()
    reader.skip_blank()
    if reader.pos != len(body):
        return None
    name = match.group(1)
    declared = parameter_schemas(tools, name) or {}
    arguments = {key: retyped(value, declared.get(key), tools[name]) if key in declared else value
                 for key, value in arguments.items()}
    return ParsedCall(name, _dumps(arguments))


class Gemma4Parser(ToolParser):
    name = "gemma4"
    tags = ("<|tool_call>", "<tool_call|>", _GEMMA_QUOTE)
    call_start = "<|tool_call>"

    def stream(self, tools: dict[str, dict] | None = None) -> ToolStream:
        return MarkedCallStream("<|tool_call>", "<tool_call|>", functools.partial(_gemma4_call, tools=tools),
                                closes=lambda tail: _OBJECT_END.search(tail) is not None)


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
