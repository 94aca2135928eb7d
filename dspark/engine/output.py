"""OutputProcessor: the engine's step outputs as each request's text, shared by the offline `LLM` and the server.

One way: `process(step outputs)` returns each followed request's delta and the ids the caller must abort in the
engine; the processor holds no engine. Its registry of followed requests is the client side's one per-request
state: each entry is the caller's own record (anything with a `state: StreamState`: the server's queue and timings,
`LLM`'s output slot), added with `add` and dropped when its request finishes, fails or is `pop`ped by the caller.

Per request: incremental detokenization with stop strings (`detokenizer.py`; a stop string that completes inside a
step finishes the delta at once and puts the request among the ids to abort), the finish reason ("stop" for a stop
string, else the engine's), the logprobs of the tokens kept, and failures: a `StepOutput.error` (the engine failed
the request) or an exception while detokenizing it ends that request alone with an error delta. `fan_out` turns one
request asking for `n` outputs into n engine requests, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from dspark.detokenizer import Detokenizer, StreamState
from dspark.sampling import SamplingParams

log = logging.getLogger(__name__)


class Followed(Protocol):
    state: StreamState  # the request's text and tokens so far


R = TypeVar("R", bound=Followed)


@dataclass
class Tracked:
    """A followed request's record where the caller keeps nothing else."""

    state: StreamState


@dataclass(frozen=True)
class OutputDelta(Generic[R]):
    """What one step added to one request, after detokenization and stop strings."""

    request_id: str
    record: R  # the caller's record of the request (its `state`: the text and tokens so far)
    output: Any  # the engine's `StepOutput` (prompt and cached token counts, spec stats, prompt logprobs)
    text: str  # newly released text (a tail that may start a stop string is held until it cannot)
    num_kept: int  # the step's new tokens kept (a stop string drops those after it)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    logprobs: list | None  # the kept tokens' `TokenLogprob`s, when the request asked
    error: str | None = None  # the request failed (finish_reason "abort"): the engine's message, or the processor's

    @property
    def state(self) -> StreamState:
        return self.record.state


class OutputProcessor(Generic[R]):
    def __init__(self, tokenizer=None):
        """`tokenizer` None: token ids only (no text, no stop strings)."""
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.requests: dict[str, R] = {}  # the followed requests, by engine request id

    def add(self, request_id: str, params: SamplingParams, record: R | None = None) -> R:
        """Follow a request; `record` (the caller's, with a fresh `state`) or a bare `Tracked` is kept for it."""
        if record is None:
            record = Tracked(StreamState.for_params(params))
        self.requests[request_id] = record
        return record

    def pop(self, request_id: str) -> R | None:
        """Stop following a request (the caller aborts it in the engine); its record, None if not followed."""
        return self.requests.pop(request_id, None)

    def process(self, outputs) -> tuple[list[OutputDelta[R]], list[str]]:
        """One step's `StepOutput`s → (a delta per followed request, in order; the ids the caller must abort in
        the engine: those a stop string or a fault of their own ended while the engine would go on). A finished
        delta's request is no longer followed; outputs of requests not followed are skipped."""
        deltas, aborts = [], []
        for out in outputs:
            record = self.requests.get(out.request_id)
            if record is None:
                continue
            try:
                delta = self._delta(out, record)
            except Exception as e:  # this request's detokenization failed: it alone ends
                log.exception("request %s failed after a step", out.request_id)
                delta = OutputDelta(out.request_id, record, out, "", 0, True, "abort", None,
                                    error=f"{type(e).__name__}: {e}")
            if delta.finished:
                del self.requests[out.request_id]
                if not out.finished:  # the engine would go on: end it where the text ended
                    aborts.append(out.request_id)
            deltas.append(delta)
        return deltas, aborts

    def _delta(self, out, record: R) -> OutputDelta[R]:
        if getattr(out, "error", None) is not None:  # the engine failed it: nothing of this step is kept
            return OutputDelta(out.request_id, record, out, "", 0, True, "abort", None, error=out.error)
        state = record.state
        if self.detokenizer is not None:
            text, kept = self.detokenizer.feed(state, out.new_token_ids)
        else:
            text, kept = "", len(out.new_token_ids)
            state.token_ids.extend(out.new_token_ids)
        finished = out.finished or state.stopped
        reason = None
        if finished:
            if self.detokenizer is not None:
                text += self.detokenizer.flush(state)
            reason = "stop" if state.stopped else (out.finish_reason or "abort")
        return OutputDelta(out.request_id, record, out, text, kept, finished, reason,
                           None if out.logprobs is None else out.logprobs[:kept])


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n > 1: n engine requests, one per output (seeded requests get seeds seed, seed + 1, ...)."""
    if n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(n)]
