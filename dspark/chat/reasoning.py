"""Reasoning parsers (`--reasoning-parser NAME`): a thinking model's output split into its reasoning and its
answer at the model's tags, as vLLM's `reasoning_content` and `content`.

Each format is a start and an end tag:
* `qwen3` (Qwen3, Qwen3.5, QwQ): `<think>` ... `</think>`;
* `deepseek_r1` (DeepSeek-R1 and its distills): the same tags; the model always reasons first, so an
  output without the start tag (its template may open it in the prompt) is reasoning up to `</think>`;
* `gemma4` (Gemma 4's thinking mode): `<|channel>thought` ... `<channel|>`.

A tool call the model opens before the end tag (Qwen3 and Qwen3.5 sometimes call while thinking; their
templates then close the thoughts implicitly) ends the thoughts at the tool parser's call marker: the call goes
to the answer, where the tool parser reads it, and the engine starts a tool or structured-output grammar there
as at the end tag (`ReasoningTags.call_start`).

Where the output starts is read off the prompt's text (`Phase`): inside an open reasoning block (the
template opened it: R1, or Qwen3 thinking models), after a closed one (a template that switched thinking
off writes an empty block), or neither, where the output may open one with the start tag. The engine uses
the same phases on token ids (`dspark.structured.AfterReasoning`) to apply a structured output or tool
grammar to the answer only. The tags must survive detokenization (they are added tokens that are not
skipped, as in these models' tokenizers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.sampling import ReasoningTags
from enum import Enum


class Phase(Enum):
    OPEN = "open"  # neither: the output may start with the start tag
    THINKING = "thinking"  # inside a reasoning block: everything up to the end tag is reasoning
    ANSWER = "answer"  # after the reasoning (or none): everything is the answer


_OPEN, _THINKING, _ANSWER = Phase.OPEN, Phase.THINKING, Phase.ANSWER  # read per piece: a global, not the enum's lookup


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    always_thinks: bool = False  # the output reasons first whether or not it writes the start tag (R1)

    def prompt_phase(self, prompt_text: str) -> Phase:
        """Where the output starts: inside a block the prompt opened, after one it closed, or open (R1:
        thinking). An output that never closes its block is all reasoning."""
        s, e = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        if s >= 0 and s > e:
            return Phase.THINKING
        if e >= 0:
            return Phase.ANSWER
        return Phase.THINKING if self.always_thinks else Phase.OPEN

    def tags(self, tokenizer, call_start: str = "") -> ReasoningTags:
        """The start and end tags (and a tool call's marker, which ends the thoughts too) as the tokenizer's ids
        (what the engine's `AfterReasoning` reads)."""
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()
        return ReasoningTags(ids(self.start), ids(self.end), self.always_thinks, ids(call_start))

    def split(self, text: str, phase: Phase, call_start: str = "") -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output starting in `phase` (None where empty)."""
        stream = self.stream(phase, call_start)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def stream(self, phase: Phase, call_start: str = "", keep_call_start: bool = True) -> "ReasoningStream":
        """`call_start`: the tool parser's call marker (`ToolParser.call_start`), which ends the thoughts where
        the model opens a call before the end tag; kept as the answer's beginning for the tool parser, or
        dropped (`keep_call_start` False: a tool grammar's answer follows it, as after the end tag)."""
        return ReasoningStream(self, phase, call_start, keep_call_start)


@dataclass
class ReasoningStream:
    """One output's split, fed piece by piece: each piece gives (reasoning delta, content delta). Text that
    may still be the start of a tag is held until it cannot be. A piece costs in proportion to its own length
    (plus a tag's): what is held is at most a partial tag, and in the open phase the leading blanks are kept
    apart as they came, never stripped again."""

    fmt: ReasoningFormat
    phase: Phase
    call_start: str = ""  # a tool call's marker: it ends the thoughts too (see ReasoningFormat.stream)
    keep_call_start: bool = True
    _held: str = ""  # open phase: the text after the leading blanks
    _at_start: bool = True  # nothing of this output read yet: a block the prompt opened may repeat its tag
    _after_end: bool = False  # the end tag just closed: the newlines the templates put after it are dropped
    _blanks: list[str] = field(default_factory=list)  # open phase: the leading blanks, held with _held

    def feed(self, text: str) -> tuple[str, str]:
        if self.phase is _OPEN and not self._held:  # only blanks so far: set this piece's apart
            head = text.lstrip()
            if len(head) < len(text):
                self._blanks.append(text[:len(text) - len(head)])
            text = head
        self._held += text
        reasoning, content = [], []
        while self._held:
            if self.phase is _ANSWER:
                if self._after_end:
                    self._held = self._held.lstrip("\n")
                    self._after_end = not self._held
                content.append(self._held)
                self._held = ""
            elif self.phase is _OPEN:  # _held: the text after the leading blanks (not empty here)
                if self._held.startswith(self.fmt.start):
                    self._held, self.phase, self._at_start = self._held[len(self.fmt.start):], _THINKING, False
                    self._blanks = []
                elif self.fmt.start.startswith(self._held):
                    break  # could still become the start tag
                else:
                    self.phase, self._held, self._blanks = _ANSWER, "".join(self._blanks) + self._held, []
            else:  # thinking: release up to the end tag, or up to a tail that may start it
                if self._at_start:  # R1 may write the start tag the phase already assumed
                    if self.fmt.start.startswith(self._held) and self._held != self.fmt.start:
                        break  # could still become the start tag
                    if self._held.startswith(self.fmt.start):
                        self._held = self._held[len(self.fmt.start):]
                    self._at_start = False
                    continue
                at = self._held.find(self.fmt.end)
                call = self._held.find(self.call_start, 0, at if at >= 0 else len(self._held)) \
                    if self.call_start else -1
                if call >= 0:  # a tool call before the end tag: the thoughts end there, the call is the answer
                    reasoning.append(self._held[:call])
                    rest = self._held[call + len(self.call_start):]
                    self._held = self.call_start + rest if self.keep_call_start else rest
                    self.phase = _ANSWER
                    continue
                if at >= 0:
                    reasoning.append(self._held[:at])
                    self._held, self.phase = self._held[at + len(self.fmt.end):], _ANSWER
                    self._after_end = True
                    continue
                keep = _partial_suffix(self._held, self.fmt.end)
                if self.call_start:
                    keep = max(keep, _partial_suffix(self._held, self.call_start))
                reasoning.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._held, self._blanks = "".join(self._blanks) + self._held, "", []
        if self.phase is _THINKING:
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: the last len(tag) - 1
    characters read, only where they hold the tag's first one."""
    at = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while at >= 0:
        if tag.startswith(text[at:]):
            return len(text) - at
        at = text.find(tag[0], at + 1)
    return 0


REASONING_FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("qwen3", "<think>", "</think>"),
    ReasoningFormat("deepseek_r1", "<think>", "</think>", always_thinks=True),
    ReasoningFormat("gemma4", "<|channel>thought", "<channel|>"),
)}


def get_reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; one of {', '.join(REASONING_FORMATS)}")
    return REASONING_FORMATS[name]
