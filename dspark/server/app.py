"""The FastAPI app: OpenAI-compatible routes (`server/routes.py`) over one `AsyncEngine`, or a `ReplicaSet` of engine
processes (`--data-parallel-size`; the same interface), with the settings, guards and error handlers it is built with.

    GET  /v1/models            the served model, once per served name (with max_model_len)
    POST /v1/completions       prompt (text or token ids) → text; SSE when stream=true
    POST /v1/chat/completions  messages → chat template → text; SSE when stream=true
    POST /v1/responses         OpenAI's Responses API over the chat path (`server/responses.py`); typed SSE events
    GET  /health               200 while the engine thread runs, 503 after it failed (replicas: 200
                               "degraded" while some serve, 503 once none does)
    GET  /metrics              Prometheus text (see `server/metrics.py`)
    GET  /get_load             {"load", "num_reqs", "num_waiting_reqs"}: the routers' power_of_two probe
    POST /tokenize             {"prompt"} or {"messages"} → {"count", "max_model_len", "tokens"} (vLLM's)
    POST /detokenize           {"tokens"} → {"prompt"}
    GET  /version              {"version"}

Every error leaves as OpenAI's body `{"error": {"message", "type", "param", "code"}}`; bad input is
a 4xx and never stops the server (the edge guards of `server/guard.py`, strict field types in
`protocol.py`, ranges in `SamplingParams`, the rest in `server/validation.py`); a fault serving one
request is a 500 with its message. Past `ServerConfig.max_num_waiting` requests get 429, while
draining 503, both with Retry-After. With an API key every route but /health and /version (and
/metrics unless `api_key_metrics`) needs `Authorization: Bearer KEY` (any of several keys). Every
served model name answers; responses carry the first.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.server.async_engine import AsyncEngine
from dspark.server.config import ServerConfig
from dspark.server.guard import APIKeyGuard, BodyGuard
from dspark.server.replicas import ReplicaSet
from dspark.server.routes import Settings, router
from dspark.server.serving import APIError, bad_request

log = logging.getLogger(__name__)


def build_app(async_engine: AsyncEngine | ReplicaSet, *, model_name: str | Sequence[str],
              api_key: str | Sequence[str] | None = None, config: ServerConfig | None = None) -> FastAPI:
    """The app over `async_engine` (built with its admission limits and metrics: `AsyncEngine`, `ReplicaSet`) with
    its settings: `model_name` the served name(s), the first reported in responses (`config.served_model_name` wins
    where set); `api_key` (one or several) overrides `config.api_key`; the config's parsers, templates, limits on
    bodies and logging apply. The routes (`server/routes.py`) read `app.state.engine` and `app.state.settings`."""
    config = config or ServerConfig()
    names = config.served_model_name or ((model_name,) if isinstance(model_name, str) else tuple(model_name))
    api_key = ((api_key,) if isinstance(api_key, str) else tuple(api_key or ())) or config.api_key

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        stats = None
        if not config.disable_log_stats and async_engine.has_local_engine:  # replicas log their own
            from dspark.server.stats_log import StatsLogger
            stats = StatsLogger(async_engine).start()
        yield
        if stats is not None:
            stats.stop()
        async_engine.shutdown()

    app = FastAPI(title="dspark", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = async_engine
    app.state.settings = Settings.of(config, names, async_engine.tokenizer, async_engine.engine_config)
    _install_error_handlers(app)
    # the last added runs first: the key is checked before the body is read
    app.add_middleware(BodyGuard, max_body_bytes=config.max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyGuard, api_key=api_key, protect_metrics=config.api_key_metrics)
    app.include_router(router)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # a fault serving this request
        log.exception("serving %s failed", request.url.path)
        err = APIError(500, f"internal error serving this request: {type(exc).__name__}: {exc}",
                       type="internal_error")
        return JSONResponse(err.body(), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(_validation_error(exc).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 list → one 400 naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return bad_request(f"malformed JSON body: {detail}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Unions report the failing member's type as a location part ("str", "list[int]"); drop those.
    field = ".".join(p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int"))
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {field}", param=field or None)
    if first.get("type") == "missing":
        return bad_request(f"missing required field {field!r}", param=field or None)
    if not field:
        return bad_request(f"invalid request body: {first['msg']}")
    return bad_request(f"invalid value for {field!r}: {first['msg']}", param=field)
