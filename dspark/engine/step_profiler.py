"""Synthetic engine steps timed for the step-cost table: `StepProfiler` builds verification batches
and draft calls on a built engine, `profile_engine` turns their timings into a `CostTable`.
How the batches are made: `dspark.cli_profile` (the `dspark profile` command).
"""

from __future__ import annotations

import datetime
import math
import platform

import torch

from dspark.kernels import kernel_kind

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
DEFAULT_DRAFT_NUM_REQS = (1, 2, 4, 8, 16, 32, 64)


class StepProfiler:
    """Synthetic verification and draft steps on a built engine. Call `close()` to free the blocks."""

    def __init__(self, engine, *, context_len: int = 256, tokens_per_request: int = 8, seed: int = 0):
        gamma = engine.drafter.num_draft_tokens if engine.drafter else 0
        self.engine = engine
        self.tokens_per_request = tokens_per_request
        # keep context + window + drafter scratch inside the model length
        room = engine.max_model_len - tokens_per_request - gamma - 1
        self.context_len = max(1, min(context_len, room))
        self.gamma = gamma
        self._rng = torch.Generator().manual_seed(seed)
        self._key = None
        self._requests = []  # the pool (KV allocated), shared by every batch
        self._windows: list[list[int]] = []  # per pool request: its longest window's draft ids
        self._drafts = []  # per request of the current batch: its window's drafts (`Drafts`)
        self._ids = 0
        self._taps: torch.Tensor | None = None  # context_step's random taps, made once per shape

    def verify_step(self, num_tokens: int) -> None:
        """One target forward over `num_tokens` verification tokens."""
        self.windows_step(_split(num_tokens, self.tokens_per_request))

    def windows_step(self, window_sizes: list[int]) -> None:
        """One target forward over one verification window per request, of these sizes (each the
        decoding token + size - 1 drafts)."""
        from dspark.request import ScheduledRequest, SchedulerOutput

        reqs = self._batch(("verify", tuple(window_sizes)), window_sizes)
        sched = SchedulerOutput(scheduled=[
            ScheduledRequest(r, 1 + len(d.ids), len(d.ids), emits=True, start_pos=self.context_len, drafts=d)
            for r, d in zip(reqs, self._drafts)])
        runner = self.engine.runner
        for state in getattr(runner.model, "states", ()):  # a hybrid target: start from an (unread) state
            for r in reqs:
                state.claim(r.state_slot, self.context_len - 1)
        runner.forward(runner.prepare(sched))
        self._sync()

    def draft_step(self, num_reqs: int) -> None:
        """One drafter proposal for `num_reqs` requests."""
        from dspark.drafters.base import ProposeBatch, ProposeRequest

        reqs = self._batch(("draft", num_reqs), [1] * num_reqs)
        spec = self.engine.config.spec
        batch = ProposeBatch(
            requests=[ProposeRequest(request_id=r.request_id, all_ids=r.all_ids,
                                     anchor_pos=self.context_len, block_table=r.block_table,
                                     num_draft_computed=self.context_len, params=r.params,
                                     generator=r.generator) for r in reqs],
            kv_block_size=self.engine.block_manager.kv_block_size,
            draft_sample_method=spec.draft_sample_method if spec else "greedy")
        with torch.inference_mode():
            self.engine.drafter.propose(batch)
        self._sync()

    def context_step(self, num_reqs: int, tokens_per_request: int) -> None:
        """One drafter context extension: `tokens_per_request` newly committed positions for each of `num_reqs`
        requests (the last ones before the anchor, random taps), as after a step that accepted that many."""
        from dspark.drafters.base import ContextSegment, ContextUpdate

        drafter, n = self.engine.drafter, tokens_per_request
        reqs = self._batch(("draft", num_reqs), [1] * num_reqs)
        width = len(drafter.tap_layer_ids) * self.engine.model_config.hidden_size
        if self._taps is None or self._taps.shape != (num_reqs * n, width):  # made once, not timed
            self._taps = torch.randn(num_reqs * n, width, generator=self._rng).to(self.engine.runner.device)
        taps = self._taps
        start = self.context_len - n
        update = ContextUpdate(segments=[
            ContextSegment(request_id=r.request_id, block_table=r.block_table, start_pos=start,
                           token_ids=r.all_ids[start:self.context_len], next_token_id=r.all_ids[self.context_len],
                           tap_rows=slice(i * n, (i + 1) * n)) for i, r in enumerate(reqs)], taps=taps)
        with torch.inference_mode():
            drafter.extend_context(update)
        self._sync()

    def close(self) -> None:
        for r in self._requests:
            self.engine.block_manager.free_request(r)
        self._requests, self._windows, self._key = [], [], None

    # -- internals -------------------------------------------------------------------------------
    def _batch(self, key, window_sizes: list[int]):
        """Requests with `context_len` committed positions and a window of each size. One pool of
        requests (grown on demand, KV allocated once) serves every key, so the timing rounds of
        `cost_table.profile` can alternate between sizes without allocating inside a timed call."""
        if key == self._key:
            return self._requests[:len(window_sizes)]
        from dspark.request import Drafts, Request
        from dspark.sampling import SamplingParams

        vocab_size = self.engine.model_config.vocab_size
        max_window = max(self.tokens_per_request, 1)
        while len(self._requests) < len(window_sizes):
            ids = torch.randint(0, vocab_size, (self.context_len + max_window,), generator=self._rng).tolist()
            req = Request(f"profile-{self._ids}", ids[:self.context_len + 1],
                          SamplingParams(temperature=0.0, max_tokens=1))
            self._ids += 1
            req.num_computed_tokens = req.num_draft_computed = self.context_len
            num_slots = self.context_len + max_window + self.gamma + 1
            if not self.engine.block_manager.allocate(req, num_slots):
                count = len(window_sizes)
                self.close()
                raise RuntimeError(f"KV pool too small for {count} requests of "
                                   f"{num_slots} slots; raise --kv-cache-memory-gb or lower "
                                   f"--context-len")
            self._requests.append(req)
            self._windows.append(ids[self.context_len + 1:])  # [max_window - 1] draft ids
        self._drafts = [Drafts(ids=tuple(window[:size - 1]), verify_len=size - 1)
                        for window, size in zip(self._windows, window_sizes)]
        self._key = key
        return self._requests[:len(window_sizes)]

    def _sync(self) -> None:
        if str(self.engine.config.device).startswith("cuda"):
            torch.cuda.synchronize()


def profile_engine(engine, *, token_counts=DEFAULT_TOKEN_COUNTS, draft_num_reqs=DEFAULT_DRAFT_NUM_REQS,
                   context_len: int = 256, tokens_per_request: int | None = None, repeats: int = 5,
                   warmup: int = 2, meta: dict | None = None):
    """Profile a built engine; returns a `CostTable` (draft curve only when it has a drafter)."""
    from dspark.speculation.cost_table import profile

    gamma = engine.drafter.num_draft_tokens if engine.drafter else 7
    profiler = StepProfiler(engine, context_len=context_len,
                            tokens_per_request=tokens_per_request or gamma + 1)
    try:
        return profile(
            profiler.verify_step, token_counts=token_counts, repeats=repeats, warmup=warmup,
            draft_fn=profiler.draft_step if engine.drafter else None,
            draft_num_reqs=draft_num_reqs if engine.drafter else (),
            meta={"context_len": profiler.context_len,
                  "tokens_per_request": profiler.tokens_per_request,
                  **_device_meta(engine), **(meta or {})})
    finally:
        profiler.close()


def _split(num_tokens: int, per_request: int) -> list[int]:
    """`num_tokens` spread evenly over ceil(num_tokens / per_request) requests."""
    num_reqs = math.ceil(num_tokens / per_request)
    base, extra = divmod(num_tokens, num_reqs)
    return [base + (i < extra) for i in range(num_reqs)]


def _device_meta(engine) -> dict:
    device = str(engine.config.device)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else (
        platform.processor() or platform.machine())
    return {"model": engine.config.model, "dtype": engine.config.dtype,
            "matmul_dtype": getattr(engine.runner.model, "matmul_dtype", "float32"), "device": device,
            "device_name": name, "num_threads": torch.get_num_threads(),
            "kernels": kernel_kind() if device == "cpu" else None,
            "speculative_method": engine.config.spec.method if engine.config.spec else None,
            "torch": torch.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
