"""The FastAPI app: OpenAI-compatible routes over one `AsyncEngine`, or a `ReplicaSet` of engine processes
(`--data-parallel-size`; the same interface).

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

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.background import BackgroundTask
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.engine.output import fan_out
from dspark.request import InvalidRequest
from dspark.server import responses, serving
from dspark.server.async_engine import AdmissionError, AsyncEngine, RequestFault, RequestStream
from dspark.server.choices import Output
from dspark.server.config import ServerConfig
from dspark.server.disconnect import unless_disconnected
from dspark.server.guard import APIKeyGuard, BodyGuard
from dspark.server.logprobs import LogprobFormatter
from dspark.server.metrics import ServerMetrics
from dspark.chat.reasoning import get_reasoning_format
from dspark.chat.special_tags import kept_tag_ids
from dspark.server.replicas import ReplicaSet
from dspark.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    ModelCard, ModelList, TokenizeRequest)
from dspark.server.responses_protocol import ResponsesRequest
from dspark.server.serving import APIError, bad_request
from dspark.server.streams import PrimedStream
from dspark.chat.tool_parsers import get_tool_parser
from dspark.server.tools import strict_check, tool_schemas
from dspark.server.tokenize import detokenize as detokenize_ids
from dspark.server.tokenize import tokenize as tokenize_ids
from dspark.generation_config import apply_defaults
from dspark.utils.host import trim_heap

log = logging.getLogger(__name__)
# a whole response this large (an echo with prompt logprobs: megabytes of JSON from far more Python objects) trims
# the heap once it is sent, so the objects' memory goes back to the OS (`utils.host.trim_heap`)
LARGE_RESPONSE_BYTES = 1 << 20


def build_app(async_engine: AsyncEngine | ReplicaSet, *, model_name: str | Sequence[str],
              api_key: str | Sequence[str] | None = None, config: ServerConfig | None = None) -> FastAPI:
    """`model_name`: the served name(s), the first reported in responses (`config.served_model_name`
    wins where set); `api_key` (one or several) overrides `config.api_key`; the config's admission
    limits are set on the engine, its logging settings apply."""
    config = config or ServerConfig()
    names = config.served_model_name or ((model_name,) if isinstance(model_name, str) else tuple(model_name))
    model_name = names[0]
    api_key = ((api_key,) if isinstance(api_key, str) else tuple(api_key or ())) or config.api_key
    async_engine.max_num_waiting = config.max_num_waiting
    async_engine.request_timeout_s = config.request_timeout_s
    retry_after = {"Retry-After": str(config.retry_after_s)}
    # a replica set (--data-parallel-size) brings its own: its replicas' metrics, merged
    metrics = getattr(async_engine, "metrics_class", ServerMetrics)(async_engine, model_name=model_name)
    async_engine.on_request_end = metrics.on_request_end
    tokenizer = async_engine.tokenizer
    engine_config = async_engine.engine_config
    defaults = {}
    if engine_config is not None:
        from dspark.generation_config import sampling_defaults
        defaults = sampling_defaults(engine_config.generation_config, engine_config.model)

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
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    _install_error_handlers(app)
    # the last added runs first: the key is checked before the body is read
    app.add_middleware(BodyGuard, max_body_bytes=config.max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyGuard, api_key=api_key, protect_metrics=config.api_key_metrics)
    v1 = APIRouter(prefix="/v1")
    auto_tools = config.enable_auto_tool_choice
    tool_parser = None if config.tool_call_parser is None else get_tool_parser(config.tool_call_parser)
    reasoning = None if config.reasoning_parser is None else get_reasoning_format(config.reasoning_parser)
    kept_tags = kept_tag_ids(tokenizer, reasoning, tool_parser)  # the parsers' tags, decoded for them

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            served = ", ".join(f"`{n}`" for n in names)
            raise APIError(404, f"The model `{name}` does not exist. Served: {served}.",
                           type="not_found_error", param="model")

    def refusal(e: AdmissionError) -> APIError:
        kind = "rate_limit_error" if e.status_code == 429 else "service_unavailable"
        return APIError(e.status_code, str(e), type=kind, headers=retry_after)

    def admit() -> None:
        """Refuse before tokenizing when the request could not be admitted anyway."""
        try:
            async_engine.check_admission()
        except AdmissionError as e:
            raise refusal(e) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    def validate(prompt_ids: list[int], params) -> None:
        """The engine's one check of a request (`request.check_request`), as a 400 naming the field."""
        try:
            async_engine.check_request(prompt_ids, params)
        except InvalidRequest as e:
            raise bad_request(str(e), param=e.param) from None

    async def add(requests: list[tuple[list[int], object, str]], client: str) -> list[RequestStream]:
        """Engine requests of one HTTP request (`client`: they take admission turns with other clients'), added in
        one go; the error of one refused as its HTTP error."""
        try:
            return await async_engine.add_requests(requests, client=client)
        except AdmissionError as e:
            raise refusal(e) from None
        except RequestFault as e:
            raise APIError(500, str(e), type="internal_error") from None
        except InvalidRequest as e:
            raise bad_request(str(e), param=e.param) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    async def start(prompts: list[list[int]], params, prefix: str = "cmpl") -> list[RequestStream]:
        """The engine requests of one HTTP request's prompts (a completions batch, or a chat's one prompt), n choices
        each, streams in prompt order (index = prompt * n + choice). Every prompt's first choice goes in at once;
        choice i > 0 of a prompt (`<id>-<i>`, seeded with seed + i) once its first choice has emitted, so they
        share its prompt's KV through the prefix cache. Ids are `cmpl-...`, chat's `chatcmpl-...` (OpenAI's and
        vLLM's), a response's `resp-...`; all of them are one client's for admission turns. The prompts are
        validated already."""
        subs = fan_out(params, params.n)
        bases = [f"{prefix}-{uuid.uuid4().hex}" for _ in prompts]
        if config.enable_log_requests:
            log.info("request %s: %d prompt(s) of %s tokens, %s", bases[0], len(prompts),
                     ", ".join(str(len(ids)) for ids in prompts[:8]), params)
        firsts = await add([(ids, subs[0], base) for ids, base in zip(prompts, bases)], bases[0])
        if params.n == 1:
            return firsts
        groups: list[list[RequestStream]] = [[s] for s in firsts]

        async def the_others(k: int) -> None:
            groups[k][0] = await PrimedStream.after_first(firsts[k])  # its prompt blocks are in the prefix cache
            groups[k] += await add([(prompts[k], sub, f"{bases[k]}-{i}") for i, sub in enumerate(subs[1:], 1)],
                                   bases[0])
        try:  # every prompt's choices settled before any error is raised, so none is left running unread
            results = await asyncio.gather(*(the_others(k) for k in range(len(prompts))), return_exceptions=True)
            error = next((r for r in results if isinstance(r, BaseException)), None)
            if error is not None:
                raise error
        except BaseException:
            for group in groups:
                for stream in group:
                    stream.close()
            raise
        return [stream for group in groups for stream in group]

    async def respond(request: Request, body, streams, shape, outputs, choices_per_prompt: int | None = None):
        if body.stream:
            opts = body.stream_options
            return StreamingResponse(
                serving.stream_response(
                    streams, shape, model=model_name,
                    include_usage=bool(opts and opts.include_usage),
                    continuous_usage=bool(opts and opts.continuous_usage_stats), outputs=outputs,
                    choices_per_prompt=choices_per_prompt),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await unless_disconnected(serving.collect_response(
            streams, shape, model=model_name, is_disconnected=request.is_disconnected,
            outputs=outputs, choices_per_prompt=choices_per_prompt), request.is_disconnected)
        if result is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        response = JSONResponse(result.model_dump())
        if len(response.body) >= LARGE_RESPONSE_BYTES:  # its objects are freed by the time it is sent: return
            response.background = BackgroundTask(trim_heap)  # their memory then (a thread), not at the next idle
        return response

    @app.get("/health")
    async def health():
        if not async_engine.is_healthy:
            raise APIError(503, f"engine is not running: {async_engine.error or 'not started'}",
                           type="service_unavailable")
        return async_engine.health_report()

    @app.get("/get_load")
    async def get_load():
        """The routers' load probe (vllm-router's and sglang-router's power_of_two read `load`): requests
        running and waiting."""
        running, waiting = async_engine.num_running, async_engine.num_queued
        return {"load": running + waiting, "num_reqs": running, "num_waiting_reqs": waiting}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render_async(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def list_models():
        root = getattr(engine_config, "model", None)
        cards = [ModelCard(id=n, root=root, max_model_len=async_engine.max_model_len) for n in names]
        return ModelList(data=cards).model_dump()

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = apply_defaults(serving.sampling_params(body, body.max_tokens, tokenizer), body, defaults)
        admit()
        prompts = serving.completion_prompts(body, tokenizer)
        for ids, _ in prompts:  # every prompt checked before any starts
            validate(ids, params)
        echo_logprobs = bool(body.echo) and params.logprobs is not None  # the prompt's tokens lead the logprobs
        outputs = []
        for ids, text in prompts:  # choices in prompt order: index = prompt * n + choice
            echo = (text if text is not None else tokenizer.decode(ids)) if body.echo else ""  # ids checked
            outputs += [Output(
                echo=echo, echo_logprobs=echo_logprobs, first_prompt_id=ids[0],
                logprobs=None if params.logprobs is None else LogprobFormatter(
                    tokenizer, chat=False, text_offset=0 if echo_logprobs else len(echo), top_k=body.logprobs),
                prompt_logprobs=None if body.prompt_logprobs is None else
                LogprobFormatter(tokenizer, chat=False, top_k=body.prompt_logprobs),
                score_only=bool(body.echo) and body.max_tokens == 0) for _ in range(params.n)]
        streams = await unless_disconnected(start([ids for ids, _ in prompts], params), request.is_disconnected)
        if streams is None:  # the client left while its choices were being added: all of them aborted
            return Response(status_code=499)
        return await respond(request, body, streams, serving.COMPLETION, outputs, choices_per_prompt=params.n)

    async def chat_streams(body: ChatCompletionRequest, request: Request, prefix: str = "chatcmpl"):
        """A validated chat request started: (params, streams, outputs), one per choice; None when the client left
        while they were being added (all of them aborted). /v1/chat/completions and /v1/responses both start here,
        so prompt rendering, sampling, tool and reasoning parsing and structured output are one path."""
        marker = serving.call_marker(body, tool_parser)
        params = apply_defaults(serving.sampling_params(body, serving.chat_max_tokens(body), tokenizer,
                                                        auto_tools=auto_tools, reasoning=reasoning, call_start=marker,
                                                        kept_special_ids=kept_tags),
                                body, defaults)
        admit()
        trusted = config.trust_request_chat_template
        if trusted and serving.request_template(body) is not None:  # rendered in a child: wait off the loop
            prompt_ids = await asyncio.to_thread(serving.chat_prompt_ids, body, tokenizer, trust_request_template=True)
        else:
            prompt_ids = serving.chat_prompt_ids(body, tokenizer, trust_request_template=trusted)
        mode = serving.tool_mode(body, auto_tools=auto_tools)
        parser = tool_parser if serving.parses_tool_calls(body, auto_tools) else None
        phase = None if reasoning is None else reasoning.prompt_phase(tokenizer.decode(prompt_ids))
        tools = tool_schemas(body) if parser is not None else None  # checked by sampling_params above
        outputs = [Output(logprobs=None if params.logprobs is None else LogprobFormatter(tokenizer, chat=True),
                                  tool_mode=mode, tool_parser=parser, tool_accept=strict_check(body), tools=tools,
                                  reasoning=None if reasoning is None else
                                  reasoning.stream(phase, marker, keep_call_start=mode is None),
                                  prompt_logprobs=None if body.prompt_logprobs is None else
                                  LogprobFormatter(tokenizer, chat=True, top_k=body.prompt_logprobs))
                   for _ in range(params.n)]
        validate(prompt_ids, params)
        streams = await unless_disconnected(start([prompt_ids], params, prefix), request.is_disconnected)
        return None if streams is None else (params, streams, outputs)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        started = await chat_streams(body, request)
        if started is None:  # the client left while its choices were being added: all of them aborted
            return Response(status_code=499)
        _, streams, outputs = started
        return await respond(request, body, streams, serving.CHAT, outputs)

    @v1.post("/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        check_model(body.model)
        with responses.responses_fields():  # an error of the chat path names the Responses field
            started = await chat_streams(responses.chat_request(body), request, "resp")
        if started is None:
            return Response(status_code=499)
        params, (stream,), (output,) = started
        return await responses.respond(request, body, params, stream, output, model=model_name, tokenizer=tokenizer)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        return tokenize_ids(body, tokenizer, max_model_len=async_engine.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        return detokenize_ids(body, tokenizer)

    @app.get("/version")
    async def version():
        from dspark import __version__
        return {"version": __version__}

    app.include_router(v1)
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
