"""The FastAPI app: OpenAI-compatible routes over one `AsyncEngine`.

    GET  /v1/models            the one served model
    POST /v1/completions       prompt (text or token ids) → text; SSE when stream=true
    POST /v1/chat/completions  messages → chat template → text; SSE when stream=true
    GET  /health               200 while the engine thread runs, 503 after it failed
    GET  /metrics              Prometheus text (see `server/metrics.py`)

Every error leaves as OpenAI's body `{"error": {"message", "type", "param", "code"}}`; bad input is
a 4xx and never stops the server. With an API key, the /v1 routes need `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import contextlib
import hmac
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.server import serving
from dspark.server.async_engine import AsyncEngine, RequestStream
from dspark.server.metrics import ServerMetrics
from dspark.server.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                    ModelList)
from dspark.server.serving import APIError, bad_request


def build_app(async_engine: AsyncEngine, *, model_name: str, api_key: str | None = None) -> FastAPI:
    metrics = ServerMetrics(async_engine)
    async_engine.on_request_end = metrics.on_request_end
    tokenizer = async_engine.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="dspark", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    _install_error_handlers(app)

    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    v1 = APIRouter(prefix="/v1")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist. Served: `{model_name}`.",
                           type="not_found_error", param="model")

    async def start(prompt_ids: list[int], params) -> RequestStream:
        try:
            return await async_engine.add_request(prompt_ids, params, f"cmpl-{uuid.uuid4().hex}")
        except ValueError as e:
            raise bad_request(str(e), param="prompt" if "prompt" in str(e) else None) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    async def respond(request: Request, body, stream, shape):
        if body.stream:
            opts = body.stream_options
            return StreamingResponse(
                serving.stream_response(
                    stream, shape, model=model_name,
                    include_usage=bool(opts and opts.include_usage),
                    continuous_usage=bool(opts and opts.continuous_usage_stats)),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await serving.collect_response(stream, shape, model=model_name,
                                                is_disconnected=request.is_disconnected)
        if result is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(result.model_dump())

    @app.get("/health")
    async def health():
        if not async_engine.is_healthy:
            raise APIError(503, f"engine is not running: {async_engine.error or 'not started'}",
                           type="service_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def list_models():
        card = ModelCard(id=model_name, max_model_len=async_engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = serving.sampling_params(body, body.max_tokens)
        prompt_ids = serving.completion_prompt_ids(body, tokenizer)
        stream = await start(prompt_ids, params)
        return await respond(request, body, stream, serving.COMPLETION)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        params = serving.sampling_params(body, serving.chat_max_tokens(body))
        prompt_ids = serving.chat_prompt_ids(body, tokenizer)
        stream = await start(prompt_ids, params)
        return await respond(request, body, stream, serving.CHAT)

    app.include_router(v1)
    return app


class _APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would wrap streaming bodies): /v1 routes need
    `Authorization: Bearer KEY`; checked before the body is read, so a bad key is always a 401."""

    def __init__(self, app, *, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or ())
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                err = APIError(401, "missing or incorrect API key "
                               "(send 'Authorization: Bearer KEY')", type="authentication_error")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status_code)

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
    if first.get("type") == "missing":
        return bad_request(f"missing required field {field!r}", param=field or None)
    if not field:
        return bad_request(f"invalid request body: {first['msg']}")
    return bad_request(f"invalid value for {field!r}: {first['msg']}", param=field)
