"""The parsers' tags that a tokenizer marks special: decoded for the parsers all the same.

A reasoning or tool-call tag may be one special token that decoding skips (Gemma 4's `<|channel>`,
`<|tool_call>` and `<|"|>`): the parsers read text, so the server and `LLM.chat` ask the detokenizer to keep
those ids (`SamplingParams.kept_special_ids`) and every other special token is skipped as before.
"""

from __future__ import annotations


def kept_tag_ids(tokenizer, reasoning=None, tool_parser=None) -> tuple[int, ...]:
    """The ids of the tags of `reasoning` (a `ReasoningFormat`) and `tool_parser` (a `ToolParser`) that decode to
    text only with special tokens kept."""
    tags = ((reasoning.start, reasoning.end) if reasoning is not None else ()) + (
        tool_parser.tags if tool_parser is not None else ())
    kept: list[int] = []
    for tag in tags:
        for t in tokenizer.encode(tag, add_special_tokens=False):
            if t not in kept and tokenizer.decode([t], skip_special_tokens=True) == "" and \
                    tokenizer.decode([t], skip_special_tokens=False) != "":
                kept.append(t)
    return tuple(kept)
