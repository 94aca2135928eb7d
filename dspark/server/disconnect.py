"""A client that leaves is noticed even while its request waits: `unless_disconnected` runs a
response coroutine beside a watcher that polls `Request.is_disconnected()` every `POLL_S`, and
cancels the coroutine (whose `finally` aborts its requests) when the client has gone. Without it a
non-streaming request that never produced a delta (still waiting) kept its place until it ran.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

POLL_S = 0.25


async def unless_disconnected(response: Awaitable, is_disconnected: Callable):
    """`response`'s result, or None when the client disconnects first."""
    work = asyncio.ensure_future(response)
    watch = asyncio.ensure_future(_until_disconnected(is_disconnected))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watch.cancel()
    try:
        return await work
    except asyncio.CancelledError:
        return None


async def _until_disconnected(is_disconnected: Callable) -> None:
    while not await is_disconnected():
        await asyncio.sleep(POLL_S)
