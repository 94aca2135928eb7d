"""The streaming half of the tool-call parsers (`dspark.chat.tool_parsers`): the parsed call and output types,
and `ToolStream`, per-request state fed each piece of generated text. Content is released as soon as it cannot
start a call marker; a call is held until its end marker (marked formats, `MarkedCallStream`) or until the
output ends (whole-output formats, `WholeOutputStream`), then sent as one `tool_calls` entry. A feed costs in
proportion to its own text (plus a marker's length) however much came before it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text (json.dumps of a dict)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text outside the calls (see the module docstring for stripping)
    calls: list[ParsedCall]


@dataclass(frozen=True)
class StreamDelta:
    """What one piece of generated text releases: content to send now and tool-call delta entries."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI `delta.tool_calls` entries


def attempt(parse: Callable, text: str):
    """parse(text), or None when it fails in any way (syntax, shape, recursion depth): a malformed call
    becomes content, never an error."""
    try:
        return parse(text)
    except Exception:
        return None


def _held_prefix_len(text: str, marker: str, lo: int = 0) -> int:
    """Length of the longest suffix of text[lo:] that is a proper prefix of marker (may still become it).
    Reads the last len(marker) - 1 characters at most, only where they hold the marker's first one."""
    at = text.find(marker[0], max(lo, len(text) - len(marker) + 1))
    while at >= 0:
        if marker.startswith(text[at:]):
            return len(text) - at
        at = text.find(marker[0], at + 1)
    return 0


class ToolStream:
    """Per-request streaming state: feed() each piece of generated text, then finish() once."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []  # the calls emitted so far, in order
        # a parsed call this refuses stays content, as one that does not parse (the server: strict tools
        # whose arguments do not validate against their schema)
        self.accept: Callable[[ParsedCall], bool] | None = None

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def _accepts(self, call: ParsedCall) -> bool:
        return self.accept is None or self.accept(call)

    def feed(self, text: str) -> StreamDelta:
        raise NotImplementedError

    def finish(self) -> StreamDelta:
        raise NotImplementedError

    def _delta(self, content: str, calls: list[ParsedCall]) -> StreamDelta:
        """A delta carrying content and one entry per call (id, type, name and the whole arguments: a call
        is released complete, so its name and arguments share its one entry; one entry per index per delta,
        as OpenAI and vLLM send); indexes count calls across the whole stream."""
        entries = []
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            entries.append({"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
        return StreamDelta(content, entries)


class MarkedCallStream(ToolStream):
    """Calls between a start and an end marker, with content around them (hermes, qwen3_coder, gemma4).

    An end marker closes the call only where the call's text before it can end there (`closes`, read on the
    call's last `TAIL` characters: a JSON object's `}`, qwen3_coder's `</function>`); any other is part of a
    value (file content that holds the marker) and the call reads on. A call whose end marker never came (EOS
    or a stop string right after it) is parsed at finish() as it stands, less a partial end marker. Each feed
    costs what its own text costs: one pass with a moving position, the end marker looked for in the new text
    plus the few characters before it that may hold its beginning; the call's pieces are kept in a list and
    joined once, when it closes or the output ends."""

    TAIL = 256  # characters of the call kept for `closes`

    def __init__(self, start: str, end: str, parse_body: Callable[[str], ParsedCall | None],
                 closes: Callable[[str], bool] = lambda tail: True) -> None:
        super().__init__()
        self._start, self._end, self._parse_body, self._closes = start, end, parse_body, closes
        self._tail = ""  # outside a call: a suffix that may begin the start marker (shorter than it)
        self._inside = False
        self._parts: list[str] = []  # inside: the call so far (its start marker first), joined at its end
        self._recent = ""  # inside: the call's last TAIL characters (after its start marker) in _parts
        self._look = ""  # inside: the last characters of _parts where the end marker may have begun

    def feed(self, text: str) -> StreamDelta:
        start, end = self._start, self._end
        content, calls = [], []
        if self._inside:  # s[:pos] is already in _parts: the end marker may have begun there
            s, pos, self._tail = self._look + text, len(self._look), ""
        else:
            s, pos, self._tail = self._tail + text, 0, ""
        search = 0  # inside: where the end marker is looked for
        while True:
            if self._inside:
                at = s.find(end, search)
                if at >= 0 and not self._closes(self._body_tail(s, pos, at)):
                    search = at + len(end)  # part of a value: read on
                    continue
                if at < 0:
                    self._append(s[pos:])
                    self._look = s[max(search, len(s) - len(end) + 1):]
                    break
                self._append(s[pos:at + len(end)])
                self._close(content, calls, end)
                pos, search = at + len(end), 0
                continue
            at = s.find(start, pos)  # outside a call, at pos of s
            if at < 0:
                free = len(s) - _held_prefix_len(s, start, pos)
                content.append(s[pos:free])
                self._tail = s[free:]
                break
            content.append(s[pos:at])
            self._parts, self._recent, self._inside = [start], "", True
            pos = search = at + len(start)
        return self._delta("".join(content), calls)

    def _append(self, piece: str) -> None:
        self._parts.append(piece)
        self._recent = (self._recent + piece[-self.TAIL:])[-self.TAIL:]

    def _body_tail(self, s: str, pos: int, at: int) -> str:
        """The call's last characters before an end marker at s[at] (s[:pos] is in _parts already)."""
        if at >= pos:
            piece = s[max(pos, at - self.TAIL):at]  # bounded: many markers inside one value cost TAIL each
            return piece if len(piece) == self.TAIL else (self._recent + piece)[-self.TAIL:]
        return self._recent[:len(self._recent) - (pos - at)]

    def _close(self, content: list[str], calls: list[ParsedCall], end: str) -> None:
        """The call in _parts (ending with `end`, the end marker or what is left of it) joined once and parsed: a
        call, or content as it was written."""
        block = "".join(self._parts)
        self._parts, self._recent, self._look, self._inside = [], "", "", False
        call = attempt(self._parse_body, block[len(self._start):len(block) - len(end)])
        if call is None or not self._accepts(call):
            content.append(block)  # a call that does not parse stays content, markers included
        else:
            calls.append(call)

    def finish(self) -> StreamDelta:
        # outside a call: a held partial start marker is content. Inside: a call whose end marker never came (or
        # came in part: a stop string cut it) is parsed as it stands; content if it does not parse
        content, calls = [], []
        if self._inside:
            block = "".join(self._parts)
            self._close(content, calls, block[len(block) - _held_prefix_len(block, self._end, len(self._start)):])
        else:
            content.append(self._tail)
        self._tail = ""
        return self._delta("".join(content), calls)


class WholeOutputStream(ToolStream):
    """The whole output is the call list, optionally after a tag, maybe followed by text (llama3_json,
    pythonic): its first non-blank characters decide; content passes straight through, a call list is held to
    finish().
    Undecided, each feed reads its own text only: the blanks so far are kept as they came (never stripped
    again), and what follows them is at most a partial tag before the decision."""

    def __init__(self, tag: str, opener: str,
                 parse_all: Callable[[str], tuple[list[ParsedCall], str] | None]) -> None:
        """`parse_all`: the whole output -> (its calls, the text after them), None where it is no call list."""
        super().__init__()
        self._tag, self._opener, self._parse_all = tag, opener, parse_all
        self._held: list[str] = []  # every piece since the start, while undecided or a call list
        self._head = ""  # undecided: the text from the first non-blank character (a partial tag)
        self._after_tag = False  # undecided: the tag was read, only blanks after it so far
        self._is_call: bool | None = None  # None until the opening characters decide

    def feed(self, text: str) -> StreamDelta:
        if self._is_call is False:
            return StreamDelta(text)
        self._held.append(text)
        if self._is_call is None:
            self._is_call = self._decide(text)
            if self._is_call is False:
                held, self._held = "".join(self._held), []
                return StreamDelta(held)
        return StreamDelta()

    def _decide(self, text: str) -> bool | None:
        """The decision with `text` added to what was fed before: the text after the leading blanks (and
        after the tag and the blanks that follow it, where it comes first) starts with the opener or not;
        None while that text is empty or may still be the tag."""
        if not self._after_tag:
            self._head = self._head + text if self._head else text.lstrip()
            head = self._head
            if not head.startswith(self._tag):
                if self._tag.startswith(head):  # blank so far, or a partial tag
                    return None
                return head.startswith(self._opener)
            self._after_tag, self._head = True, ""
            text = head[len(self._tag):]
        head = text.lstrip()  # after the tag: everything before this text was blank
        return head.startswith(self._opener) if head else None

    def finish(self) -> StreamDelta:
        held, self._held = "".join(self._held), []
        if self._is_call:
            parsed = attempt(self._parse_all, held)
            if parsed is not None and parsed[0] and all(self._accepts(c) for c in parsed[0]):
                return self._delta(parsed[1], parsed[0])  # the calls, then the text after them
        return self._delta(held, [])
