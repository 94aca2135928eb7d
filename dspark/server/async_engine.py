"""AsyncEngine: the synchronous `Engine` driven by one thread, for an asyncio server.

The engine thread is a background thread started with the app (tests, embedding), or — `dspark serve` —
the process's main thread, with uvicorn's event loop in a background thread (`run_forever`): libgomp
gives a non-main thread's parallel regions less spinning (it throttles once the process has more
OpenMP threads than cores), which made every kernel-per-op step of a served engine ~30% slower.

Threading contract:
- Only the engine thread touches the `Engine` (add_request, abort, step) and the output processor
  (`dspark.engine.output`: detokenization, stop strings, finish reasons, shared with the offline `LLM`).
  Coroutines hand it commands through a locked list and a condition variable; the thread applies
  them between steps, and sleeps on the condition while there is no work (no busy loop).
- The processor's registry is this side's one record per live request (`_Tracked`: its queue, deadline,
  timings and text so far); the engine's `requests` is the other side's.
- Results go back through one `asyncio.Queue` per request, fed with `loop.call_soon_threadsafe`.
- Detokenization (and so stop strings) runs on the engine thread, right after each step: the processor
  returns the requests a stop string ended, and they are aborted before the next step is scheduled; the
  held-back tail guarantees no text past the stop string is ever sent.
- A client that goes away calls `RequestStream.close()`; at the next loop turn the engine request is
  aborted, which frees its KV blocks at once.

Admission and faults:
- `max_num_waiting` bounds the requests admitted but not yet running (queued commands + the scheduler's
  waiting list); past it `add_request` raises `AdmissionError(429)`; while draining (`begin_drain`,
  SIGTERM) `AdmissionError(503)`.
- `request_timeout_s`: a request still unfinished that long after arrival is aborted, and its stream
  ends with an error delta (status 504).
- One request's fault (the engine refusing it, its detokenization failing, a non-finite target
  logit: `StepOutput.error`) ends that request only, with an error delta (500) carrying the message.
  An exception out of `Engine.step()` itself fails every request and stops the loop (`error` set,
  /health 503; `dspark serve` then exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from dspark.detokenizer import StreamState
from dspark.engine.output import OutputDelta, OutputProcessor
from dspark.request import SpecStats
from dspark.sampling import SamplingParams
from dspark.server.metrics import RequestRecord, ServerMetrics, ServerStats
from dspark.server.streams import RequestDelta, RequestStream
from dspark.utils.host import IDLE_TRIM_S
from dspark.utils.host import trim_heap_on_cpu as _trim_when_idle

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    state: StreamState
    arrival_s: float
    num_prompt_tokens: int
    deadline_s: float | None = None  # time.perf_counter() past which the request is aborted
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tracked: _Tracked
    future: asyncio.Future = field(repr=False)
    client: str | None = None  # `Engine.add_request`'s: requests that take admission turns together


@dataclass(frozen=True)
class _Abort:
    request_id: str


class RequestFault(Exception):
    """Serving this one request failed (a 500 with the message); the engine carries on."""


class AdmissionError(Exception):
    """The server does not take the request now: 429 (queue full) or 503 (draining)."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code


class AsyncEngine:
    def __init__(self, engine, tokenizer, *, own_thread: bool = True, max_num_waiting: int | None = None,
                 request_timeout_s: float | None = None, model_name: str = "dspark", metrics_engine: str = "0"):
        """`max_num_waiting` (None: unbounded) and `request_timeout_s` (None: none): admission and deadlines;
        `model_name` and `metrics_engine`: the labels of its Prometheus metrics (`metrics`; `metrics_engine`: the
        replica's index under --data-parallel-size)."""
        self.engine = engine
        self.max_num_waiting = max_num_waiting
        self.request_timeout_s = request_timeout_s
        self.own_thread = own_thread  # False: the caller runs the loop with `run_forever()`
        self.tokenizer = tokenizer  # bundle with .tokenizer (HF) for decoding
        # detokenization, stop strings, finish reasons; its registry holds each live request's `_Tracked`
        # (engine thread only)
        self.output: OutputProcessor[_Tracked] = OutputProcessor(tokenizer.tokenizer)
        self.metrics = ServerMetrics(self, model_name=model_name, engine=metrics_engine)
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._looping = False  # the engine loop runs (on its own thread or the caller's)
        self.error: str | None = None  # set if the engine thread died
        self.draining = False  # `begin_drain`: new requests get 503
        self._drain_deadline_s: float | None = None  # the loop ends when drained; aborts past it
        self._num_queued_adds = 0  # _Add commands not yet applied (event loop increments)
        self.num_rejected = {429: 0, 503: 0}  # admission refusals, for /metrics
        self.num_failed = 0  # requests ended by their own fault (500) or deadline (504)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self.own_thread and self._thread is None:
            self._looping = True
            self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
            self._thread.start()

    def run_forever(self) -> None:
        """Run the engine loop in the calling thread until `shutdown()` (own_thread=False), or until
        the engine dies (then `error` is set)."""
        if self.own_thread:
            raise RuntimeError("run_forever() needs AsyncEngine(own_thread=False)")
        self._looping = True
        self._run()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._looping

    def health_report(self) -> dict:
        """/health's body while healthy (a replica set adds its replicas' states)."""
        return {"status": "ok"}

    def begin_drain(self, timeout_s: float | None = None) -> None:
        """Stop admitting (503); requests in flight carry on. With `timeout_s` the engine loop ends
        once every request has finished, aborting those still running `timeout_s` from now.
        Thread-safe, and signal-handler safe (the condition's lock is re-entrant)."""
        self.draining = True
        if timeout_s is not None:
            self._drain_deadline_s = time.perf_counter() + timeout_s
        with self._cond:
            self._cond.notify()

    @property
    def is_drained(self) -> bool:
        return not self.output.requests and not self._num_queued_adds

    def abort_all(self) -> None:
        """Abort every request in flight (end of a drain)."""
        for request_id in list(self.output.requests):
            self.abort(request_id)

    # -- read-only views for /metrics, /health and validation (plain reads, benign from any thread) ---
    has_local_engine = True  # the engine is in this process: the app's stats line reads it

    @property
    def engine_config(self):
        """The engine's `EngineConfig` (None for a bare test engine without one)."""
        return getattr(self.engine, "config", None)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_active(self) -> int:
        """Requests with a live stream (accepted, not yet finished or aborted)."""
        return len(self.output.requests)

    @property
    def num_queued(self) -> int:
        """Requests admitted but not running: commands not yet applied + the scheduler's waiting."""
        return self._num_queued_adds + self.engine.stats().num_waiting

    def stats(self) -> ServerStats:
        """One snapshot for /health, /get_load, /metrics and the stats line, with the engine's `EngineStats`."""
        engine = self.engine.stats()
        return ServerStats(healthy=self.is_healthy, error=self.error, health=self.health_report(),
                           num_running=engine.num_running, num_queued=self._num_queued_adds + engine.num_waiting,
                           num_active=self.num_active, num_rejected=dict(self.num_rejected),
                           num_failed=self.num_failed, engine=engine)

    def drain_histogram_samples(self) -> tuple[list[int], list[int]]:
        """The engine's verify lengths and coalescing holds since the last call (for /metrics' histograms)."""
        m = self.engine.metrics
        return m.drain_verify_lens(), m.drain_coalesce_held_steps()

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's check of a request (`Engine.check_request`, reading only its limits), with prompt +
        max_tokens within the context: raised before the request is queued."""
        self.engine.check_request(prompt_ids, params, max_tokens_fit=True)

    # -- requests (event loop side) --------------------------------------------------------------
    def check_admission(self) -> None:
        """Raise as `add_request` would refuse a request now (RuntimeError: the engine died;
        AdmissionError 503 draining, 429 queue full): the server calls it before tokenizing, so a
        refused request costs no tokenization."""
        if self.error is not None:
            raise RuntimeError(f"engine is not running: {self.error}")
        if self.draining:
            self.num_rejected[503] += 1
            raise AdmissionError(503, "the server is shutting down and admits no new requests")
        num_queued = self.num_queued
        if self.max_num_waiting is not None and num_queued >= self.max_num_waiting:
            self.num_rejected[429] += 1
            raise AdmissionError(429, f"the server is overloaded: {num_queued} requests are "
                                      f"waiting (max_num_waiting={self.max_num_waiting}); retry later")

    async def add_request(self, prompt_ids: list[int], params: SamplingParams,
                          request_id: str, *, client: str | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Raises ValueError for
        input the engine rejects (too long, bad token ids, ...), RuntimeError if the engine died,
        AdmissionError when it is not admitted (`check_admission`)."""
        return (await self.add_requests([(prompt_ids, params, request_id)], client=client))[0]

    async def add_requests(self, requests: list[tuple[list[int], SamplingParams, str]], *,
                           client: str | None = None) -> list[RequestStream]:
        """Queue several requests (prompt ids, params, request id) at once, as one client's: the engine takes
        them all in one turn of its loop (not one a step), and they take admission turns with other clients'
        requests (`Scheduler.add`). Their streams in order once all are accepted; where one is refused, the
        others are aborted and its error raised (as `add_request`)."""
        self.check_admission()
        self.start()
        loop = asyncio.get_running_loop()
        adds = []
        for prompt_ids, params, request_id in requests:
            state = StreamState.for_params(params)
            arrival_s = time.perf_counter()
            deadline_s = None if self.request_timeout_s is None else arrival_s + self.request_timeout_s
            tracked = _Tracked(queue=asyncio.Queue(), loop=loop, state=state, arrival_s=arrival_s,
                               num_prompt_tokens=len(prompt_ids), deadline_s=deadline_s)
            adds.append(_Add(request_id, list(prompt_ids), params, tracked, loop.create_future(), client))
        with self._cond:
            self._num_queued_adds += len(adds)
        self._submit(*adds)
        futures = [a.future for a in adds]
        try:
            await asyncio.wait(futures)
        except BaseException:  # the client left before the engine took them: none of them runs
            self._abort_all(adds)
            raise
        error = next((f.exception() for f in futures if f.exception() is not None), None)
        if error is not None:  # one was refused: none of them runs
            self._abort_all(adds)
            raise error
        return [RequestStream(self, a.request_id, a.tracked.queue) for a in adds]

    def _abort_all(self, adds: list[_Add]) -> None:
        for a in adds:
            if not a.future.done():
                a.future.cancel()
            elif not a.future.cancelled():
                a.future.exception()  # retrieved: one refusal is raised, the others' need no warning
            self.abort(a.request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for a request that has already finished."""
        self._submit(_Abort(request_id))

    def _submit(self, *commands: _Add | _Abort) -> None:
        with self._cond:
            self._commands.extend(commands)
            self._cond.notify()

    # -- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._looping = False

    def _loop(self) -> None:
        engine = self.engine
        busy = False
        trim_at = None  # idle since the last request ended: when its memory goes back (`_trim_when_idle`)
        while True:
            with self._cond:
                while not (self._commands or self._stopping or busy
                           or self._drain_deadline_s is not None):
                    if trim_at is not None and time.perf_counter() >= trim_at:
                        break
                    self._cond.wait(None if trim_at is None else trim_at - time.perf_counter())
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            if trim_at is not None and not (commands or busy) and time.perf_counter() >= trim_at:
                trim_at = None
                _trim_when_idle(engine)  # outside the lock: a submission never waits for it
                continue
            if self._drain_deadline_s is not None and not commands and not busy:
                if self.is_drained:
                    return  # every admitted request has finished: the drain is done
                with self._cond:  # a request's command is on its way: wait for it
                    self._cond.wait(0.05)
                continue
            if self._drain_deadline_s is not None and time.perf_counter() > self._drain_deadline_s:
                for rid in list(self.output.requests):  # past the drain timeout: abort what is left
                    commands.append(_Abort(rid))
            try:
                for command in commands:
                    self._apply(command)
                if self.request_timeout_s is not None:
                    self._expire(time.perf_counter())
                stepped = engine.has_unfinished()
                if stepped:
                    deltas, aborts = self.output.process(engine.step())
                    for rid in aborts:  # a stop string or the request's own fault ended it here
                        engine.abort(rid)
                    for delta in deltas:
                        self._deliver(delta)
                busy = engine.has_unfinished()
                if busy:
                    trim_at = None
                elif stepped:  # it ended the last requests (also one it admitted): responses out, objects freed
                    trim_at = time.perf_counter() + IDLE_TRIM_S
            except Exception as e:  # a bug or device error: fail every request, refuse new ones
                log.exception("engine step failed; the server stops accepting requests")
                self._die(f"{type(e).__name__}: {e}")
                return

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._end(command.request_id)  # its stream (if anyone still reads it) ends "abort"
            return
        with self._cond:
            self._num_queued_adds -= 1
        try:
            self.engine.add_request(command.prompt_ids, command.params, command.request_id, client=command.client)
        except ValueError as e:
            call_soon(command.tracked.loop, settle, command.future, e)
            return
        except Exception as e:  # a fault of this request's own (the engine is untouched): a 500
            log.exception("adding request %s failed", command.request_id)
            self.engine.abort(command.request_id)
            call_soon(command.tracked.loop, settle, command.future,
                       RequestFault(f"{type(e).__name__}: {e}"))
            return
        self.output.add(command.request_id, command.params, command.tracked)
        call_soon(command.tracked.loop, settle, command.future, None)

    def _expire(self, now_s: float) -> None:
        late = [rid for rid, t in self.output.requests.items()
                if t.deadline_s is not None and now_s > t.deadline_s]
        for rid in late:
            self._fail(rid, f"request exceeded its deadline of {self.request_timeout_s:g} s "
                            f"(request_timeout_s)", status=504)

    def _fail(self, request_id: str, message: str, *, status: int = 500) -> None:
        """End one request with an error delta (`status`: its HTTP status)."""
        if request_id in self.output.requests:
            self.num_failed += 1
        self._end(request_id, message, status)

    def _end(self, request_id: str, error: str | None = None, status: int = 500) -> None:
        """Abort one request in the engine (its blocks are freed at once) and end its stream with a
        finished delta, reason "abort", carrying `error` if given."""
        tracked = self.output.pop(request_id)
        if tracked is None:
            return
        final = self.engine.abort(request_id)
        self._send_end(request_id, tracked, final, error, status)

    def _send_end(self, request_id: str, tracked: _Tracked, final, error: str | None, status: int) -> None:
        """The finished delta, reason "abort", of a request ended outside its own output (`final`: the engine's
        last `StepOutput` of it, or None)."""
        delta = RequestDelta(
            request_id=request_id, text="", num_tokens=0, finished=True, finish_reason="abort",
            num_prompt_tokens=tracked.num_prompt_tokens,
            num_output_tokens=len(tracked.state.token_ids),
            num_cached_tokens=0 if final is None else final.num_cached_tokens,
            spec=SpecStats() if final is None else _snapshot(final.spec), error=error, error_status=status)
        call_soon(tracked.loop, tracked.queue.put_nowait, delta)
        self._record_end(request_id, tracked, "abort")

    def _deliver(self, delta: OutputDelta[_Tracked]) -> None:
        out, tracked = delta.output, delta.record
        if delta.error is not None:  # 400 where the request's own constraints caused it (request.RequestError)
            self.num_failed += 1
            self._send_end(out.request_id, tracked, None, delta.error, getattr(delta.error, "status", 500))
            return
        now_s = time.perf_counter()
        if delta.num_kept and tracked.first_token_s is None:
            tracked.first_token_s = now_s
        if delta.num_kept:
            tracked.token_times_s.append(now_s)
        call_soon(tracked.loop, tracked.queue.put_nowait, RequestDelta(
            request_id=out.request_id, text=delta.text, num_tokens=delta.num_kept, finished=delta.finished,
            finish_reason=delta.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=len(tracked.state.token_ids), num_cached_tokens=out.num_cached_tokens,
            spec=_snapshot(out.spec), prompt_logprobs=out.prompt_logprobs, logprobs=delta.logprobs))
        if delta.finished:
            self._record_end(out.request_id, tracked, delta.finish_reason, end_s=now_s)

    def _record_end(self, request_id: str, tracked: _Tracked, reason: str,
                    end_s: float | None = None) -> None:
        record = RequestRecord(
            request_id=request_id, finish_reason=reason,
            num_prompt_tokens=tracked.num_prompt_tokens,
            num_output_tokens=len(tracked.state.token_ids), arrival_s=tracked.arrival_s,
            first_token_s=tracked.first_token_s, end_s=end_s or time.perf_counter(),
            token_times_s=tuple(tracked.token_times_s))
        try:
            self.metrics.on_request_end(record)
        except Exception:
            log.exception("observing the end of request %s failed", request_id)

    def _die(self, message: str) -> None:
        self.error = message
        with self._cond:
            pending, self._commands = self._commands, []
            self._num_queued_adds = 0
        for command in pending:
            if isinstance(command, _Add):
                call_soon(command.tracked.loop, settle, command.future,
                           RuntimeError(f"engine is not running: {message}"))
        for request_id, tracked in self.output.requests.items():
            delta = RequestDelta(
                request_id=request_id, text="", num_tokens=0, finished=True, finish_reason="abort",
                num_prompt_tokens=tracked.num_prompt_tokens,
                num_output_tokens=len(tracked.state.token_ids),
                num_cached_tokens=0, spec=SpecStats(), error=f"engine failed: {message}")
            call_soon(tracked.loop, tracked.queue.put_nowait, delta)
        self.output.requests.clear()


def _snapshot(spec: SpecStats) -> SpecStats:
    return SpecStats(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                     list(spec.accepted_per_pos))


def settle(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    """The future's error, or its result; nothing where the awaiting coroutine was cancelled."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """fn(*args) on the event loop's thread; nothing where the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed (server shutting down)
        pass
