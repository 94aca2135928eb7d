"""The request streams of one response: `RequestStream` (one engine request's `RequestDelta`s, as the async
engine hands them to the event loop), n > 1 choices merged in arrival order, and a stream whose first delta was
read ahead (the fan-out waits for choice 0's first token, so the others hit its prompt blocks in the prefix
cache)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from dspark.request import SpecStats


@dataclass(frozen=True)
class RequestDelta:
    """What one step added to one request, as the HTTP layer sees it."""

    request_id: str
    text: str  # newly released text (stop-truncated; a tail that may start a stop string is held)
    num_tokens: int  # output tokens this delta carries (after stop truncation)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int  # kept output tokens so far
    num_cached_tokens: int  # prompt tokens served by a prefix-cache hit
    spec: SpecStats  # a snapshot, safe to read on the event loop
    error: str | None = None  # set when the request failed; the request is over
    error_status: int = 500  # the HTTP status of that failure (504: past its deadline)
    logprobs: list | None = None  # [num_tokens] sampling.TokenLogprob, when the request asked
    prompt_logprobs: list | None = None  # [None, then sampling.TokenLogprob per prompt token]: first delta, if asked


class RequestStream:
    """Async iterator over one request's `RequestDelta`s; ends after the finished delta.
    `close()` aborts the request if it has not finished (idempotent; call it in a `finally`)."""

    def __init__(self, owner, request_id: str, queue: asyncio.Queue):  # owner: the AsyncEngine (its abort)
        self.request_id = request_id
        self._owner = owner
        self._queue = queue
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        delta: RequestDelta = await self._queue.get()
        if delta.finished:
            self._done = True
        return delta

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._owner.abort(self.request_id)


class PrimedStream:
    """A request stream whose first delta was already read (the n > 1 fan-out waits for it)."""

    def __init__(self, stream: RequestStream, first: RequestDelta | None):
        self.request_id = stream.request_id
        self._stream, self._first = stream, first

    @classmethod
    async def after_first(cls, stream: RequestStream) -> "PrimedStream":
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            stream.close()
            raise
        return cls(stream, first)

    def __aiter__(self) -> "PrimedStream":
        return self

    async def __anext__(self) -> RequestDelta:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._stream.__anext__()

    def close(self) -> None:
        self._stream.close()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(choice index, delta) from n streams, in arrival order."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, delta = await queue.get()
            if delta is None:
                left -= 1
            else:
                yield i, delta
    finally:
        for t in tasks:
            t.cancel()
