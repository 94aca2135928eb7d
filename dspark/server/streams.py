"""The request streams of one response: n > 1 choices merged in arrival order, and a stream whose first
delta was read ahead (the fan-out waits for choice 0's first token, so the others hit its prompt blocks in
the prefix cache)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from dspark.server.async_engine import RequestDelta, RequestStream


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
