"""`ReplicaSet`: N engine processes behind one API server (`dspark serve --data-parallel-size N`), with the
interface of `AsyncEngine` that the app reads (`stats()`, `metrics`, admission, requests), so `build_app` and
`serve_app` take either.

Each replica is a child process (`python -m dspark.server.replica`, started with `subprocess`, not forked:
its own interpreter, its own torch threads and KV pool) that runs the existing `Engine` + `AsyncEngine`
loop and talks to this process over a socket pair in framed JSON (`dspark.server.wire`: plain data only,
nothing unpickled). What the replica does is what one `dspark serve` does: admission (`max_num_waiting`),
deadlines, detokenization and stop strings, speculation with its own drafter, its own Prometheus metrics
under `engine="<index>"`. This process tokenizes, validates against the replicas' limits, routes
(`dspark.server.balance`: fewest outstanding requests, with prefix affinity) and merges the replicas'
metrics at each scrape.

Cores: replica i gets `threads` torch threads and (where the OS allows it) is pinned to its own share of
this process's CPUs, so replicas do not contend for cores.

Faults: a replica that dies fails only its own requests (their streams end with an error, a 500), the
others keep serving; /health answers 200 "degraded" naming the dead ones while one serves, 503 once none
does (`error` is then set and `dspark serve` exits non-zero). Drain (SIGTERM): no new requests (503), each
replica finishes what it runs within the timeout and exits; `run_forever` returns when all have.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from dspark.request import SpecStats, check_request
from dspark.server.async_engine import AdmissionError, RequestFault, call_soon, settle
from dspark.server.balance import Balancer, BalanceConfig
from dspark.server.metrics import ServerStats, merge_expositions
from dspark.server.streams import RequestDelta, RequestStream
from dspark.server.wire import Channel, delta_from_wire, error_from_wire, params_to_wire

log = logging.getLogger(__name__)
METRICS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ReplicaLaunch:
    """How a replica builds its engine: `factory` ("module:function") called with `args` (plain JSON data)
    returns (engine, tokenizer bundle). `dspark serve` passes its own command line
    (`dspark.server.cli:replica_engine`); tests pass a tiny engine's."""

    factory: str
    args: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)  # added to the replica's environment


def core_shares(size: int, cpus: list[int] | None = None) -> list[list[int]]:
    """This process's CPUs split into `size` contiguous shares (each at least one CPU; shares repeat CPUs
    only where there are fewer CPUs than replicas)."""
    cpus = sorted(cpus if cpus is not None else _usable_cpus())
    if len(cpus) < size:
        return [[cpus[i % len(cpus)]] for i in range(size)]
    base, extra = divmod(len(cpus), size)
    out, start = [], 0
    for i in range(size):
        n = base + (i < extra)
        out.append(cpus[start:start + n])
        start += n
    return out


def _usable_cpus() -> list[int]:
    getter = getattr(os, "sched_getaffinity", None)
    return sorted(getter(0)) if getter else list(range(os.cpu_count() or 1))


class _Replica:
    """This process's handle on one replica: its process, channel and requests in flight."""

    def __init__(self, index: int, proc: subprocess.Popen, channel: Channel):
        self.index, self.proc, self.channel = index, proc, channel
        self.state = "starting"  # starting | ready | draining | exited | dead
        self.error: str | None = None
        self.limits: dict = {}
        self.streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}  # request id ->
        self.pending: dict[int, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}  # tag -> add / metrics
        self.reader: threading.Thread | None = None

    @property
    def takes_requests(self) -> bool:
        return self.state == "ready"

    def send(self, message: dict) -> bool:
        try:
            self.channel.send(message)
            return True
        except OSError:  # its end is gone: the reader reports the death
            return False


class ReplicaSetMetrics:
    """/metrics of a replica set: every live replica's own exposition (its samples under `engine="<i>"`),
    merged into one text at each scrape, with the requests this process refused itself (503 while draining, before
    any replica saw them) under `engine="api"` in `vllm:num_requests_rejected_total`."""

    def __init__(self, replicas: "ReplicaSet", *, model_name: str = "dspark"):
        self.replicas, self.model_name = replicas, model_name

    async def render_async(self) -> bytes:
        return merge_expositions([*await self.replicas.metrics_texts(), self._own()])

    def _own(self) -> str:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily
        from dspark.server.metrics import LABELS, PREFIX, CollectedFamilies
        rejected = CounterMetricFamily(PREFIX + "num_requests_rejected", "Requests refused at admission: 429 past "
                                       "max_num_waiting, 503 while draining.", labels=LABELS + ["status"])
        for status, value in sorted(self.replicas.num_rejected.items()):
            rejected.add_metric([self.model_name, "api", str(status)], value)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(CollectedFamilies([rejected]))
        return generate_latest(registry).decode()


class ReplicaSet:
    has_local_engine = False

    def __init__(self, launch: ReplicaLaunch, size: int, *, tokenizer, engine_config=None,
                 threads: int | None = None, pin_cores: bool = True, model_name: str = "dspark",
                 max_num_waiting: int | None = None, request_timeout_s: float | None = None,
                 affinity_slack: int = 4, log_level: str = "info"):
        if size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {size}")
        self.launch_spec, self.size, self.tokenizer = launch, size, tokenizer
        self.engine_config = engine_config
        self.threads = threads or max(1, len(_usable_cpus()) // size)
        self.pin_cores, self.model_name = pin_cores, model_name
        self._limits = {"max_num_waiting": max_num_waiting, "request_timeout_s": request_timeout_s}
        self.affinity_slack, self.log_level = affinity_slack, log_level
        self.balancer: Balancer | None = None
        self.replicas: list[_Replica] = []
        self.metrics = ReplicaSetMetrics(self, model_name=model_name)
        self.draining = False
        self.num_rejected = {429: 0, 503: 0}
        self._lock = threading.Lock()  # replicas' streams and pending maps (event loop and reader threads)
        self._tags = itertools.count()
        self._done = threading.Event()  # every replica has exited, or shutdown()

    # -- lifecycle ---------------------------------------------------------------------------------------
    def launch(self, timeout_s: float = 3600.0) -> "ReplicaSet":
        """Start every replica and wait until each has built its engine; one that fails stops them all and
        raises its error."""
        shares = core_shares(self.size) if self.pin_cores else [None] * self.size
        try:
            self.replicas = [self._start(0, shares[0])]  # alone first: a GGUF's converted cache is written once
            self._await_ready(self.replicas[0], timeout_s)
            self.replicas += [self._start(i, shares[i]) for i in range(1, self.size)]
            for r in self.replicas[1:]:
                self._await_ready(r, timeout_s)
        except BaseException:
            self.shutdown()
            raise
        first = self.replicas[0].limits
        self.balancer = Balancer(BalanceConfig(block_size=first["block_size"], affinity_slack=self.affinity_slack))
        for r in self.replicas:
            r.reader = threading.Thread(target=self._read, args=(r,), name=f"dspark-replica{r.index}", daemon=True)
            r.reader.start()
        return self

    def _start(self, index: int, cpus: list[int] | None) -> _Replica:
        ours, theirs = socket.socketpair()
        env = {**os.environ, **self.launch_spec.env, "OMP_NUM_THREADS": str(self.threads)}
        proc = subprocess.Popen([sys.executable, "-m", "dspark.server.replica"], stdin=subprocess.PIPE,
                                pass_fds=(theirs.fileno(),), env=env)
        spec = {"index": index, "fd": theirs.fileno(), "factory": self.launch_spec.factory,
                "args": self.launch_spec.args, "threads": self.threads, "cpus": cpus,
                "model_name": self.model_name, "log_level": self.log_level, **self._limits}
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        theirs.close()
        return _Replica(index, proc, Channel(ours))

    def _await_ready(self, r: _Replica, timeout_s: float) -> None:
        r.channel.sock.settimeout(timeout_s)
        try:
            message = r.channel.receive()
        except TimeoutError:
            raise RuntimeError(f"replica {r.index} did not start within {timeout_s:g} s") from None
        r.channel.sock.settimeout(None)
        if message is None or message.get("op") != "ready":
            code = r.proc.wait(10)
            detail = (message or {}).get("error") or f"it exited with code {code}"
            raise RuntimeError(f"replica {r.index} failed to start: {detail}")
        r.limits, r.state = message["limits"], "ready"

    def start(self) -> None:
        """The app's lifespan start: the replicas run already (`launch`)."""
        if not self.replicas:
            self.launch()

    def run_forever(self) -> None:
        """Block until every replica has exited (drained or dead) or `shutdown()`."""
        while not self._done.wait(0.5):
            pass

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close every replica's channel (a replica leaves its loop when its channel closes), then wait for
        them; one that does not exit in time is killed."""
        self._done.set()
        for r in self.replicas:
            r.channel.close()
        for r in self.replicas:
            try:
                r.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait(timeout_s)

    def begin_drain(self, timeout_s: float | None = None) -> None:
        """No new requests (503); each replica finishes its running ones (aborting those still running
        `timeout_s` from now) and exits."""
        self.draining = True
        for r in self.replicas:
            if r.state == "ready":
                r.state = "draining"
                r.send({"op": "drain", "timeout_s": timeout_s})

    # -- state --------------------------------------------------------------------------------------------
    @property
    def error(self) -> str | None:
        """Set once no replica serves for a fault (not a drain)."""
        if any(r.state in ("starting", "ready", "draining") for r in self.replicas) or not self.replicas:
            return None
        dead = [f"replica {r.index}: {r.error}" for r in self.replicas if r.state == "dead"]
        return "; ".join(dead) or None

    @property
    def is_healthy(self) -> bool:
        return any(r.state in ("ready", "draining") for r in self.replicas)

    def health_report(self) -> dict:
        states = [{"index": r.index, "state": r.state, "requests": len(r.streams),
                   **({"error": r.error} if r.error else {})} for r in self.replicas]
        ok = all(r.state in ("ready", "draining") for r in self.replicas)
        return {"status": "ok" if ok else "degraded", "replicas": states}

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].limits["max_model_len"]

    @property
    def num_active(self) -> int:
        return sum(len(r.streams) for r in self.replicas)

    @property
    def num_running(self) -> int:
        """Requests the replicas hold (running or waiting there): this process sees no finer split."""
        return self.num_active

    num_queued = 0  # admitted but not yet running: counted by each replica, in its own /metrics

    @property
    def max_num_waiting(self) -> int | None:
        return self._limits["max_num_waiting"]

    @property
    def request_timeout_s(self) -> float | None:
        return self._limits["request_timeout_s"]

    def stats(self) -> ServerStats:
        """One snapshot for /health and /get_load (each replica's engine reports in its own /metrics)."""
        return ServerStats(healthy=self.is_healthy, error=self.error, health=self.health_report(),
                           num_running=self.num_running, num_queued=self.num_queued, num_active=self.num_active,
                           num_rejected=dict(self.num_rejected))

    # -- requests (event loop side) -----------------------------------------------------------------------
    def check_admission(self) -> None:
        if self.draining:
            self.num_rejected[503] += 1
            raise AdmissionError(503, "the server is shutting down and admits no new requests")
        if not any(r.takes_requests for r in self.replicas):
            raise RuntimeError(f"engine is not running: {self.error or 'no replica takes requests'}")

    def check_request(self, prompt_ids: list[int], params) -> None:
        limits = self.replicas[0].limits
        check_request(prompt_ids, params, max_model_len=limits["max_model_len"], vocab_size=limits["vocab_size"],
                      max_logprobs=limits["max_logprobs"], max_tokens_fit=True)

    async def add_request(self, prompt_ids, params, request_id: str, *, client: str | None = None) -> RequestStream:
        return (await self.add_requests([(prompt_ids, params, request_id)], client=client))[0]

    async def add_requests(self, requests: list[tuple[list[int], object, str]], *,
                           client: str | None = None) -> list[RequestStream]:
        """One HTTP request's engine requests, all to one replica (the balancer's pick for the first prompt);
        their streams once the replica has accepted them, else its refusal raised as `AsyncEngine` raises it."""
        self.check_admission()
        loop = asyncio.get_running_loop()
        tag, future = next(self._tags), loop.create_future()
        queues = {rid: asyncio.Queue() for _, _, rid in requests}
        with self._lock:
            loads = [len(r.streams) if r.takes_requests else None for r in self.replicas]
            replica = self.replicas[self.balancer.pick(list(requests[0][0]), loads)]
            replica.pending[tag] = (future, loop)
            for rid, queue in queues.items():
                replica.streams[rid] = (queue, loop)
        sent = replica.send({"op": "add", "tag": tag, "client": client,
                             "requests": [[list(ids), params_to_wire(p), rid] for ids, p, rid in requests]})
        try:
            if not sent:
                raise RequestFault(f"replica {replica.index} is gone")
            await future
        except BaseException:  # refused, the replica died, or the client left: none of them runs
            for rid in queues:
                self.abort(rid)
                self._forget(replica, rid)
            with self._lock:
                replica.pending.pop(tag, None)
            raise
        return [RequestStream(self, rid, queue) for rid, queue in queues.items()]

    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for a request that has already finished."""
        with self._lock:  # the replica whose streams hold it (its one record in this process)
            replica = next((r for r in self.replicas if request_id in r.streams), None)
        if replica is not None and replica.state in ("ready", "draining"):
            replica.send({"op": "abort", "id": request_id})

    def _forget(self, replica: _Replica, request_id: str) -> None:
        with self._lock:
            replica.streams.pop(request_id, None)

    async def metrics_texts(self) -> list[str]:
        """Every live replica's Prometheus text (one that does not answer in time is left out)."""
        loop = asyncio.get_running_loop()
        asks = []
        for r in self.replicas:
            if r.state not in ("ready", "draining"):
                continue
            tag, future = next(self._tags), loop.create_future()
            with self._lock:
                r.pending[tag] = (future, loop)
            if r.send({"op": "metrics", "tag": tag}):
                asks.append(future)
        done, _ = await asyncio.wait(asks, timeout=METRICS_TIMEOUT_S) if asks else (set(), set())
        return [f.result() for f in asks if f in done and not f.exception()]

    # -- reader threads ------------------------------------------------------------------------------------
    def _read(self, r: _Replica) -> None:
        """One replica's messages, until its channel closes."""
        try:
            while (message := r.channel.receive()) is not None:
                self._handle(r, message)
        except (OSError, ValueError) as e:  # a broken frame or socket: the replica is treated as gone
            r.error = r.error or f"its channel broke: {e}"
        self._on_exit(r)

    def _handle(self, r: _Replica, message: dict) -> None:
        op = message["op"]
        if op == "delta":
            delta = delta_from_wire(message["delta"])
            with self._lock:
                target = r.streams.get(delta.request_id)
            if target is not None:
                queue, loop = target
                call_soon(loop, queue.put_nowait, delta)
                if delta.finished:
                    self._forget(r, delta.request_id)
            return
        if op == "dead":
            r.error = message.get("error")
            return
        with self._lock:
            future, loop = r.pending.pop(message["tag"], (None, None))
        if future is None:
            return
        if op == "added":
            call_soon(loop, settle, future, None)
        elif op == "refused":
            call_soon(loop, settle, future, error_from_wire(message["error"]))
        elif op == "metrics":
            call_soon(loop, settle, future, None, message["text"])

    def _on_exit(self, r: _Replica) -> None:
        """The replica's channel closed: it drained and exited, or it died. Its requests in flight end with
        an error; waiting adds and scrapes are answered."""
        try:
            code = r.proc.wait(10)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            code = r.proc.wait(10)
        drained = self._done.is_set() or (r.state == "draining" and code == 0)  # shut down, or drained
        if not drained:
            r.error = r.error or f"the replica process exited with code {code}"
            log.error("replica %d died (%s); its requests fail, the other replicas keep serving", r.index, r.error)
        r.state = "exited" if drained else "dead"
        with self._lock:
            streams, r.streams = r.streams, {}
            pending, r.pending = r.pending, {}
        message = f"replica {r.index} failed: {r.error}"
        for rid, (queue, loop) in streams.items():
            call_soon(loop, queue.put_nowait, RequestDelta(
                request_id=rid, text="", num_tokens=0, finished=True, finish_reason="abort", num_prompt_tokens=0,
                num_output_tokens=0, num_cached_tokens=0, spec=SpecStats(), error=message))
        for future, loop in pending.values():
            call_soon(loop, settle, future, RequestFault(message))
        if all(x.state in ("exited", "dead") for x in self.replicas):
            self._done.set()
