"""The replica wire: messages between the API process and its engine replicas (`dspark.server.replicas`),
one JSON object a frame (a 4-byte big-endian length, then UTF-8 JSON) over a local socket pair.

Only plain data crosses: prompt ids, `SamplingParams` as a dict of its fields, `RequestDelta`s as dicts,
errors as (kind, message, status, param). Nothing is unpickled (tests/test_no_pickle.py): a frame is JSON,
and each message kind is rebuilt field by field into the dataclass it came from.

API process → replica: {"op": "add", "tag", "client", "requests": [[prompt ids, params, request id], ...]},
{"op": "abort", "id"}, {"op": "drain", "timeout_s"}, {"op": "metrics", "tag"} (the admission limits come with the
start-up spec).
Replica → API process: {"op": "ready", "limits"}, {"op": "failed", "error"} (it could not build its
engine), {"op": "added", "tag"}, {"op": "refused", "tag", "error"}, {"op": "delta", "delta"},
{"op": "metrics", "tag", "text"}, {"op": "dead", "error"} (its engine loop died).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading

from dspark.request import InvalidRequest, SpecStats
from dspark.sampling import ReasoningTags, SamplingParams, TokenLogprob
from dspark.server.async_engine import AdmissionError, RequestFault
from dspark.server.streams import RequestDelta

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30  # a frame longer than this is a broken peer, not a message


class Channel:
    """Framed JSON messages over a connected stream socket. `send` is thread-safe; one thread receives."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self._reader = sock.makefile("rb")

    def send(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        with self._send_lock:
            self.sock.sendall(HEADER.pack(len(data)) + data)

    def receive(self) -> dict | None:
        """The next message; None once the peer has closed its end."""
        header = self._reader.read(HEADER.size)
        if len(header) < HEADER.size:
            return None
        (size,) = HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            raise ConnectionError(f"a replica frame of {size} bytes")
        data = self._reader.read(size)
        if len(data) < size:
            return None
        return json.loads(data)

    def close(self) -> None:
        """Shut the socket down (a thread blocked in `receive` gets the end) and close it. The reader's
        file is left to its thread: closing it here would wait for that thread's read."""
        for close in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                close()
            except OSError:
                pass


# -- sampling parameters ---------------------------------------------------------------------------------
def params_to_wire(params: SamplingParams) -> dict:
    return {f.name: getattr(params, f.name) if f.name != "reasoning_tags" or params.reasoning_tags is None
            else dataclasses.asdict(params.reasoning_tags) for f in dataclasses.fields(params)}


def params_from_wire(data: dict) -> SamplingParams:
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"unknown sampling parameters on the replica wire: {sorted(unknown)}")
    values = {k: v if k == "structured_outputs" else _tuples(v) for k, v in data.items()}
    if values.get("reasoning_tags") is not None:
        values["reasoning_tags"] = ReasoningTags(**{k: _tuples(v) for k, v in data["reasoning_tags"].items()})
    return SamplingParams(**values)


def _tuples(value):
    """JSON's lists back to the tuples the frozen dataclasses hold."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# -- deltas -----------------------------------------------------------------------------------------------
def delta_to_wire(delta: RequestDelta) -> dict:
    out = {f.name: getattr(delta, f.name) for f in dataclasses.fields(delta)}
    out["spec"] = dataclasses.asdict(delta.spec)
    return out


def delta_from_wire(data: dict) -> RequestDelta:
    values = dict(data)
    values["spec"] = SpecStats(**data["spec"])
    values["logprobs"] = _logprobs(data.get("logprobs"))
    values["prompt_logprobs"] = _logprobs(data.get("prompt_logprobs"))
    return RequestDelta(**values)


def _logprobs(entries: list | None) -> list | None:
    if entries is None:
        return None
    return [None if e is None else TokenLogprob(e[0], e[1], [tuple(t) for t in e[2]], e[3]) for e in entries]


# -- errors: what refusing an add raised in the replica, raised again in the API process --------------------
def error_to_wire(error: BaseException) -> dict:
    kind = next((name for name, cls in ERRORS.items() if isinstance(error, cls)), "fault")
    return {"kind": kind, "message": str(error) if kind != "fault" or isinstance(error, RequestFault)
            else f"{type(error).__name__}: {error}",
            "status": getattr(error, "status_code", None), "param": getattr(error, "param", None)}


def error_from_wire(data: dict) -> BaseException:
    kind, message = data["kind"], data["message"]
    if kind == "admission":
        return AdmissionError(data["status"], message)
    if kind == "invalid":
        return InvalidRequest(message, data.get("param"))
    return ERRORS.get(kind, RequestFault)(message)


# the order matters: the first class an error is an instance of names its kind
ERRORS: dict[str, type[BaseException]] = {
    "admission": AdmissionError, "invalid": InvalidRequest, "value": ValueError, "fault": RequestFault,
    "runtime": RuntimeError,
}
