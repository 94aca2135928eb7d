"""Incremental detokenization and stop strings, shared by the offline `LLM` and the server.

Tokens are fed one at a time, so a stop string that completes inside a multi-token speculative run
ends the output at the same token plain decoding would have stopped at: nothing after it leaks.
While streaming, the last len(longest stop) − 1 characters are held back until they can no longer start
a stop string. Special tokens are skipped, but those a request keeps (`SamplingParams.kept_special_ids`: the
reasoning and tool-call tags the server's parsers read, where the tokenizer marks them special). Byte-level BPE
can split a character across tokens, so text is only released once the decoded window
no longer ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StreamState:
    stop: tuple[str, ...]
    include_stop_str_in_output: bool = False
    keep: frozenset[int] = frozenset()  # special tokens decoded all the same (the parsers' tags)
    token_ids: list[int] = field(default_factory=list)  # kept output tokens
    text: str = ""  # decoded text so far (stop-truncated)
    num_released: int = 0  # characters of `text` already handed out (streaming holds back a tail
    # that could still be the start of a stop string)
    prefix_offset: int = 0
    read_offset: int = 0
    stopped: bool = False

    @classmethod
    def for_params(cls, params) -> "StreamState":
        """A request's state from its `SamplingParams` (stop strings, kept special tokens)."""
        return cls(stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                   keep=frozenset(params.kept_special_ids))


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # anything with decode(ids, skip_special_tokens=...)

    def _decode(self, ids: list[int], keep: frozenset[int] = frozenset()) -> str:
        """The text of `ids`, special tokens skipped but those in `keep` (a run of others decoded together)."""
        if keep.isdisjoint(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        pieces, run = [], []
        for t in ids:
            if t in keep:
                if run:
                    pieces.append(self.tokenizer.decode(run, skip_special_tokens=True))
                    run = []
                pieces.append(self.tokenizer.decode([t], skip_special_tokens=False))
            else:
                run.append(t)
        if run:
            pieces.append(self.tokenizer.decode(run, skip_special_tokens=True))
        return "".join(pieces)

    def feed(self, state: StreamState, new_ids: list[int]) -> tuple[str, int]:
        """Add tokens; returns (new text, number of the new tokens kept). Sets `state.stopped` when a
        stop string completes; the text is cut before it (or after it with include_stop_str_in_output)
        and later tokens are dropped."""
        kept = 0
        for token in new_ids:
            if state.stopped:
                break
            state.token_ids.append(token)
            kept += 1
            ids = state.token_ids
            prefix = self._decode(ids[state.prefix_offset:state.read_offset], state.keep)
            full = self._decode(ids[state.prefix_offset:], state.keep)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta = full[len(prefix):]
                state.prefix_offset, state.read_offset = state.read_offset, len(ids)
                self._append(state, delta)
        return self._release(state, final=state.stopped), kept

    def flush(self, state: StreamState) -> str:
        """The held-back tail, once the request has finished."""
        return self._release(state, final=True)

    @staticmethod
    def _release(state: StreamState, *, final: bool) -> str:
        hold = 0 if final or not state.stop else max(len(s) for s in state.stop) - 1
        end = max(state.num_released, len(state.text) - hold)
        out = state.text[state.num_released:end]
        state.num_released = end
        return out

    def _append(self, state: StreamState, delta: str) -> None:
        if not state.stop:
            state.text += delta
            return
        longest = max(len(s) for s in state.stop)
        search_from = max(0, len(state.text) - longest + 1)
        text = state.text + delta
        hits = [(i, s) for s in state.stop if (i := text.find(s, search_from)) >= 0]
        if hits:
            i, s = min(hits)
            state.text = text[:i + len(s)] if state.include_stop_str_in_output else text[:i]
            state.stopped = True
        else:
            state.text = text
