"""The periodic stats line of `dspark serve` (vLLM's; `--disable-log-stats` turns it off): prompt and
generation throughput over the interval, running / waiting requests, KV usage, prefix-cache hit rate and,
with speculation, the acceptance over the interval; each line reads one `AsyncEngine.stats()` snapshot."""

from __future__ import annotations

import asyncio
import logging
import time

from dspark.engine.metrics import EngineStats

log = logging.getLogger("dspark.stats")
INTERVAL_S = 10.0


class StatsLogger:
    def __init__(self, async_engine, interval_s: float = INTERVAL_S):
        self.async_engine = async_engine
        self.interval_s = interval_s
        self.task: asyncio.Task | None = None
        self._last = self._snapshot()

    def _snapshot(self, m: EngineStats | None = None) -> tuple[float, ...]:
        m = m or self.async_engine.stats().engine
        return (time.perf_counter(), m.num_prompt_tokens, m.num_generation_tokens, m.num_drafts,
                m.num_draft_tokens, m.num_accepted_tokens, m.num_prefix_cache_queries, m.num_prefix_cache_hits)

    def line(self) -> str:
        """The stats since the previous line (or since start)."""
        m = self.async_engine.stats().engine
        now = self._snapshot(m)
        t, prompt, gen, drafts, draft_tokens, accepted, queries, hits = (a - b for a, b in zip(now, self._last))
        self._last = now
        t = max(t, 1e-9)
        text = (f"prompt throughput: {prompt / t:.1f} tokens/s, generation throughput: {gen / t:.1f} tokens/s, "
                f"running: {m.num_running} reqs, waiting: {m.num_waiting} reqs, "
                f"KV cache usage: {100 * m.kv_usage:.1f}%, prefix cache hit rate: "
                f"{100 * hits / queries if queries else 0.0:.1f}%")
        if drafts:
            text += (f"; speculative decoding: mean acceptance length {1 + accepted / drafts:.2f}, "
                     f"accepted {accepted}/{draft_tokens} draft tokens")
        return text

    def start(self) -> "StatsLogger":
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            log.info(self.line())
