"""OutputProcessor: the engine's step outputs as each request's text, shared by the offline `LLM` and the server.

Per request: incremental detokenization with stop strings (`detokenizer.py`; a stop string that completes
inside a step ends the request in the engine, and the step after reports it), the finish reason ("stop" for a
stop string, else the engine's), and the logprobs of the tokens kept. `fan_out` turns one request asking for
`n` outputs into n engine requests, as vLLM does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dspark.detokenizer import Detokenizer, StreamState
from dspark.sampling import SamplingParams


@dataclass(frozen=True)
class OutputDelta:
    """What one step added to one request, after detokenization and stop strings."""

    text: str  # newly released text (a tail that may start a stop string is held until it cannot)
    num_kept: int  # the step's new tokens kept (a stop string drops those after it)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    logprobs: list | None  # the kept tokens' `TokenLogprob`s, when the request asked
    state: StreamState  # the request's text and tokens so far


class OutputProcessor:
    def __init__(self, engine, tokenizer=None):
        """`tokenizer` None: token ids only (no text, no stop strings)."""
        self.engine = engine
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.states: dict[str, StreamState] = {}
        self.reap = False  # a request was aborted after a step: the next step reports (and drops) it

    def add(self, request_id: str, params: SamplingParams) -> StreamState:
        state = StreamState.for_params(params)
        self.states[request_id] = state
        return state

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request in the engine and stop following it."""
        self.states.pop(request_id, None)
        self.engine.abort(request_id, reason)
        self.reap = True

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or self.reap

    def step(self) -> list:
        self.reap = False
        return self.engine.step()

    def process(self, out) -> OutputDelta | None:
        """One `StepOutput` → its delta; None for a request this processor does not follow (aborted, or ended by a
        stop string in an earlier step)."""
        state = self.states.get(out.request_id)
        if state is None:
            return None
        if self.detokenizer is not None:
            text, kept = self.detokenizer.feed(state, out.new_token_ids)
        else:
            text, kept = "", len(out.new_token_ids)
            state.token_ids.extend(out.new_token_ids)
        if state.stopped and not out.finished:  # the engine would go on: end it where the text ended
            self.engine.abort(out.request_id, "stop")
            self.reap = True
        finished = out.finished or state.stopped
        reason = None
        if finished:
            if self.detokenizer is not None:
                text += self.detokenizer.flush(state)
            reason = "stop" if state.stopped else (out.finish_reason or "abort")
            del self.states[out.request_id]
        return OutputDelta(text=text, num_kept=kept, finished=finished, finish_reason=reason,
                           logprobs=None if out.logprobs is None else out.logprobs[:kept], state=state)


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n > 1: n engine requests, one per output (seeded requests get seeds seed, seed + 1, ...)."""
    if n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(n)]
