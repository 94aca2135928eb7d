"""`ServerConfig`: the HTTP front end of `dspark serve` — address, served names, API keys, chat template,
logging, limits and security (frozen; checked in `__post_init__`). Its flags are generated from the
fields' `opt(...)` metadata by `dspark.engine_args`, like the engine's (`add_server_args`,
`server_config_from_args`), in vLLM's spellings.

The API keys come from `--api-key` (one or several: any of them opens the routes), else
`DSPARK_API_KEY`, else `VLLM_API_KEY` (for drop-in users).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from dspark.utils.options import human_int, opt

API_KEY_ENV = ("DSPARK_API_KEY", "VLLM_API_KEY")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    host: str = opt("127.0.0.1", "address to bind (0.0.0.0 exposes the server on the network)")
    port: int = opt(8000, "port to bind")
    served_model_name: tuple[str, ...] = opt((), "the model name(s) clients send; every one answers, the "
                                             "first is reported (default: the model argument)")
    chat_template: str | None = opt(None, "a Jinja chat template, as a file path or inline (default: the "
                                    "model's own)")
    # a request's own chat_template (a template is code): refused with a 400 unless set; then rendered in a child
    # process under a time, size and memory budget (dspark/server/request_template.py)
    trust_request_chat_template: bool = opt(False, "accept chat_template in requests (rendered in a child "
                                            "process under a time, size and memory budget)")
    enable_log_requests: bool = opt(False, "log each request's parameters and prompt length",
                                    negatives=("--disable-log-requests",))
    uvicorn_log_level: str = opt("info", "log level of the server and uvicorn", aliases=("--log-level",),
                                 choices=UVICORN_LOG_LEVELS)
    disable_log_stats: bool = opt(False, "no periodic throughput / KV-usage log line")
    # requests admitted but not yet running; past it new requests get 429 with Retry-After
    max_num_waiting: int = opt(256, "requests admitted but not yet running; beyond it 429 with Retry-After")
    # seconds from arrival to the end of a request; past it the request is aborted (504) (None: none)
    request_timeout_s: float | None = opt(None, "per-request deadline in seconds from arrival (504 past it); "
                                          "default none")
    max_request_body_bytes: int = opt(4 * 2**20, "largest accepted POST body (413 beyond it; 4M = 4 MiB)",
                                      parse=human_int)
    # on SIGTERM: stop admitting (503), let running requests finish this long, abort the rest, exit 0
    drain_timeout_s: float = opt(30.0, "on SIGTERM: seconds running requests may finish before they are aborted")
    # required as 'Authorization: Bearer KEY' (all but /health, /version); several: any of them
    api_key: tuple[str, ...] = opt((), "require 'Authorization: Bearer KEY' on every route but /health and "
                                   "/version; several keys: any of them (default: $DSPARK_API_KEY, else "
                                   "$VLLM_API_KEY)")
    api_key_metrics: bool = opt(False, "require the API key on /metrics too")
    retry_after_s: int = opt(1, "Retry-After seconds sent with 429 / 503")
    # open connections uvicorn serves at once; past it 503 before any body is read (None: no limit):
    # with max_request_body_bytes it bounds the memory request bodies can take
    max_connections: int | None = opt(None, "open connections served at once (503 beyond it, before reading a "
                                      "body); default no limit")
    # chat requests with tools and tool_choice "auto" (OpenAI's default with tools): generated freely, the
    # model's own tool-call format parsed into tool_calls (dspark/chat/tool_parsers.py)
    enable_auto_tool_choice: bool = opt(False, "tool_choice 'auto': parse the model's tool calls (needs "
                                        "--tool-call-parser)")
    tool_call_parser: str | None = opt(None, "the model's tool-call format: hermes, qwen3_coder, llama3_json, "
                                             "pythonic, gemma4")
    # a thinking model's reasoning apart in reasoning_content; structured output and tool grammars apply to
    # the answer after it (dspark/chat/reasoning.py)
    reasoning_parser: str | None = opt(None, "the model's reasoning tags: qwen3, deepseek_r1, gemma4")
    # N engine processes on this host behind this server, each with its share of the cores and its own KV pool;
    # requests balanced by load with prefix affinity (dspark/server/replicas.py)
    data_parallel_size: int = opt(1, "engine replicas on this host behind this server (each its own process, "
                                  "share of the cores and KV pool)", aliases=("-dp",))

    def __post_init__(self) -> None:
        keys = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())
        object.__setattr__(self, "api_key", keys)
        names = self.served_model_name
        object.__setattr__(self, "served_model_name", (names,) if isinstance(names, str) else tuple(names))
        for name in ("max_num_waiting", "max_request_body_bytes", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.api_key_metrics and not self.api_key:
            raise ValueError("api_key_metrics needs an API key")
        if any(not k for k in self.api_key):
            raise ValueError("api_key: an empty key would open the server")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser NAME)")
        if self.tool_call_parser is not None:
            from dspark.chat.tool_parsers import get_tool_parser
            get_tool_parser(self.tool_call_parser)  # ValueError naming the parsers
        if self.reasoning_parser is not None:
            from dspark.chat.reasoning import get_reasoning_format
            get_reasoning_format(self.reasoning_parser)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """One flag per `ServerConfig` field, generated (dspark.engine_args)."""
    from dspark.engine_args import add_arguments
    add_arguments(p, ServerConfig)


def resolve_api_key(flag, environ=os.environ):
    """The key(s) of the flag, else of the environment (None where there is none)."""
    if flag:
        return flag
    return next((environ[k] for k in API_KEY_ENV if environ.get(k)), None)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    from dspark.engine_args import config_from_args
    args = argparse.Namespace(**vars(args))
    args.api_key = resolve_api_key(getattr(args, "api_key", None)) or ()
    try:
        return config_from_args(args, ServerConfig)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
