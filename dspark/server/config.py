"""`ServerConfig`: the HTTP server's limits and security settings (frozen; checked in `__post_init__`),
and its `dspark serve` flags, one per field (`add_server_args`, `server_config_from_args`).

The API key comes from `--api-key`, else `DSPARK_API_KEY`, else `VLLM_API_KEY` (for drop-in users).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

API_KEY_ENV = ("DSPARK_API_KEY", "VLLM_API_KEY")


@dataclass(frozen=True)
class ServerConfig:
    # requests admitted but not yet running; past it new requests get 429 with Retry-After
    max_num_waiting: int = 256
    # seconds from arrival to the end of a request; past it the request is aborted (504) (None: none)
    request_timeout_s: float | None = None
    max_request_body_bytes: int = 4 * 2**20  # larger POST bodies get 413
    # on SIGTERM: stop admitting (503), let running requests finish this long, abort the rest, exit 0
    drain_timeout_s: float = 30.0
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' (all but /health, /version)
    api_key_metrics: bool = False  # also require it on /metrics
    retry_after_s: int = 1  # the Retry-After header of a 429 / 503
    # open connections uvicorn serves at once; past it 503 before any body is read (None: no limit):
    # with max_request_body_bytes it bounds the memory request bodies can take
    max_connections: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_waiting", "max_request_body_bytes", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.api_key_metrics and not self.api_key:
            raise ValueError("api_key_metrics needs an API key")


HELP = {
    "max_num_waiting": "requests admitted but not yet running; beyond it 429 with Retry-After",
    "request_timeout_s": "per-request deadline in seconds from arrival (504 past it); default none",
    "max_request_body_bytes": "largest accepted POST body (413 beyond it)",
    "drain_timeout_s": "on SIGTERM: seconds running requests may finish before they are aborted",
    "api_key": "require 'Authorization: Bearer KEY' on every route but /health and /version "
               "(default: $DSPARK_API_KEY, else $VLLM_API_KEY)",
    "api_key_metrics": "require the API key on /metrics too",
    "retry_after_s": "Retry-After seconds sent with 429 / 503",
    "max_connections": "open connections served at once (503 beyond it, before reading a body); "
                       "default no limit",
}


def add_server_args(p: argparse.ArgumentParser) -> None:
    """One flag per `ServerConfig` field (`--max-num-waiting` ...), defaults from the dataclass."""
    defaults = ServerConfig()
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=HELP[f.name])
        elif f.name in ("request_timeout_s", "max_connections"):
            kind = float if f.name == "request_timeout_s" else int
            p.add_argument(flag, type=kind, default=None, help=HELP[f.name])
        elif f.name == "api_key":
            p.add_argument(flag, default=None, help=HELP[f.name])
        else:
            p.add_argument(flag, type=type(default), default=default, help=HELP[f.name])


def resolve_api_key(flag: str | None, environ=os.environ) -> str | None:
    if flag:
        return flag
    return next((environ[k] for k in API_KEY_ENV if environ.get(k)), None)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in fields(ServerConfig) if hasattr(args, f.name)}
    values["api_key"] = resolve_api_key(values.get("api_key"))
    try:
        return ServerConfig(**values)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
