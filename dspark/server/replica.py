"""One engine replica of `dspark serve --data-parallel-size N` (`python -m dspark.server.replica`, started by
`dspark.server.replicas.ReplicaSet`): the existing `Engine` + `AsyncEngine` loop, driven over a socket by the
API process instead of by HTTP routes.

Its start-up spec arrives as one JSON object on stdin: its index, the inherited socket's fd, the engine
factory ("module:function" and its plain-JSON args), its torch threads and CPUs, the served model name and
the admission limits. It pins itself to its CPUs, builds the engine, answers {"op": "ready", "limits"} and
then serves the wire's messages (`dspark.server.wire`).

Threads, as in `dspark serve`: the engine loop runs on the main thread (libgomp gives it full spinning); an
asyncio loop on a second thread holds the request streams and forwards each delta; a third reads the socket.
The channel closing (the API process gone or shutting down) stops the engine loop; so does the end of a
drain. A dead engine loop is reported ({"op": "dead"}) after its requests' error deltas, and the process
exits non-zero.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import socket
import sys
import threading

from dspark.server.async_engine import AsyncEngine
from dspark.server.wire import Channel, delta_to_wire, error_to_wire, params_from_wire

log = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 10.0


def load_factory(name: str):
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def pin(threads: int | None, cpus: list[int] | None) -> None:
    """This process on its CPUs (where the OS can pin) with its torch threads."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            log.warning("could not pin the replica to CPUs %s: %s", cpus, e)
    if threads:
        import torch
        torch.set_num_threads(threads)


class Replica:
    def __init__(self, engine, tokenizer, channel: Channel, spec: dict):
        self.index = spec["index"]
        self.channel = channel
        self.async_engine = AsyncEngine(engine, tokenizer, own_thread=False,
                                        max_num_waiting=spec.get("max_num_waiting"),
                                        request_timeout_s=spec.get("request_timeout_s"),
                                        model_name=spec.get("model_name") or "dspark", metrics_engine=str(self.index))
        self.loop = asyncio.new_event_loop()
        self.pumps: set[asyncio.Task] = set()
        self.handlers = {"add": self._add, "abort": self._abort, "drain": self._drain, "metrics": self._metrics}

    def limits(self) -> dict:
        engine = self.async_engine.engine
        config = getattr(engine, "config", None)
        return {"max_model_len": engine.max_model_len, "vocab_size": engine.model_config.vocab_size,
                "max_logprobs": getattr(config, "max_logprobs", 20),
                "block_size": engine.stats().kv_block_size}

    def run(self) -> int:
        threading.Thread(target=self.loop.run_forever, name="dspark-replica-loop", daemon=True).start()
        self.channel.send({"op": "ready", "limits": self.limits()})
        threading.Thread(target=self._read, name="dspark-replica-reader", daemon=True).start()
        self.async_engine.run_forever()  # until drained, shut down or dead
        try:
            asyncio.run_coroutine_threadsafe(self._flush(), self.loop).result(FLUSH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the channel is gone: nobody reads the rest
            pass
        error = self.async_engine.error
        if error is not None:
            self._send({"op": "dead", "error": error})
        self.channel.close()
        return 1 if error is not None else 0

    # -- the socket -> the event loop ---------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while (message := self.channel.receive()) is not None:
                self.loop.call_soon_threadsafe(self._dispatch, message)
        except (OSError, ValueError):
            pass
        self.async_engine.shutdown()  # the API process is gone or closed the channel: stop

    def _dispatch(self, message: dict) -> None:
        handler = self.handlers.get(message.get("op"))
        if handler is None:
            log.error("replica %d: unknown message %r", self.index, message.get("op"))
            return
        handler(message)

    def _send(self, message: dict) -> None:
        try:
            self.channel.send(message)
        except OSError:  # the API process is gone; the reader stops the engine
            pass

    # -- handlers (event loop thread) ------------------------------------------------------------------------
    def _add(self, message: dict) -> None:
        task = self.loop.create_task(self._add_requests(message))
        self.pumps.add(task)
        task.add_done_callback(self.pumps.discard)

    async def _add_requests(self, message: dict) -> None:
        tag = message["tag"]
        try:
            requests = [(list(ids), params_from_wire(params), rid) for ids, params, rid in message["requests"]]
            streams = await self.async_engine.add_requests(requests, client=message.get("client"))
        except Exception as e:  # noqa: BLE001 - the refusal goes back as the error it is
            self._send({"op": "refused", "tag": tag, "error": error_to_wire(e)})
            return
        self._send({"op": "added", "tag": tag})
        for stream in streams:
            task = self.loop.create_task(self._pump(stream))
            self.pumps.add(task)
            task.add_done_callback(self.pumps.discard)

    async def _pump(self, stream) -> None:
        async for delta in stream:
            self._send({"op": "delta", "delta": delta_to_wire(delta)})

    def _abort(self, message: dict) -> None:
        self.async_engine.abort(message["id"])

    def _drain(self, message: dict) -> None:
        # after the first step of every add already dispatched (their tasks' first steps are queued ahead of this
        # callback): a request the API process sent before the drain passed its admission there and is finished,
        # not refused
        self.loop.call_soon(self.async_engine.begin_drain, message.get("timeout_s"))

    def _metrics(self, message: dict) -> None:
        self._send({"op": "metrics", "tag": message["tag"], "text": self.async_engine.metrics.render().decode()})

    async def _flush(self) -> None:
        """Let the streams forward their last deltas (a drain's or a death's)."""
        await asyncio.sleep(0)
        if self.pumps:
            await asyncio.wait(set(self.pumps), timeout=FLUSH_TIMEOUT_S)


def main() -> int:
    spec = json.loads(sys.stdin.read())
    level = spec.get("log_level") or "info"
    logging.basicConfig(level=logging.DEBUG if level == "trace" else getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    channel = Channel(socket.socket(fileno=spec["fd"]))
    pin(spec.get("threads"), spec.get("cpus"))
    try:
        engine, tokenizer = load_factory(spec["factory"])(spec.get("args") or {})
    except BaseException as e:  # noqa: BLE001 - reported to the API process, which names it
        log.exception("replica %d could not build its engine", spec["index"])
        channel.send({"op": "failed", "error": f"{type(e).__name__}: {e}"})
        channel.close()
        return 1
    log.info("replica %d ready (%s torch threads, CPUs %s)", spec["index"], spec.get("threads"), spec.get("cpus"))
    return Replica(engine, tokenizer, channel, spec).run()


if __name__ == "__main__":
    sys.exit(main())
