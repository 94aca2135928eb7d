"""Incremental detokenization and stop strings, shared by the offline `LLM` and the server.

Tokens are fed one at a time, so a stop string that completes inside a multi-token speculative run
ends the output at the same token plain decoding would have stopped at: nothing after it leaks.
While streaming, the last len(longest stop) − 1 characters are held back until they can no longer start
a stop string. Byte-level BPE can split a character across tokens, so text is only released once the decoded window
no longer ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StreamState:
    stop: tuple[str, ...]
    include_stop_str_in_output: bool = False
    token_ids: list[int] = field(default_factory=list)  # kept output tokens
    text: str = ""  # decoded text so far (stop-truncated)
    num_released: int = 0  # characters of `text` already handed out (streaming holds back a tail
    # that could still be the start of a stop string)
    prefix_offset: int = 0
    read_offset: int = 0
    stopped: bool = False


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # anything with decode(ids, skip_special_tokens=...)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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
            prefix = self._decode(ids[state.prefix_offset:state.read_offset])
            full = self._decode(ids[state.prefix_offset:])
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
