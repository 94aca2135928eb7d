"""The OpenAI-compatible routes as plain functions on one `APIRouter` (`build_app` in `server/app.py` mounts it).

A route reads what it serves through two dependencies on `request.app.state`: `engine` (an `AsyncEngine`, or a
`ReplicaSet` under --data-parallel-size: the same interface) and `settings` (`Settings`: the served names, the
tokenizer and what the `ServerConfig` turns on, built once with the app). So a route runs against any app whose
state holds those two, a stub engine included (tests/test_server_routes.py). /health, /get_load and /metrics read
one `stats()` snapshot of the engine.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from dspark.chat.reasoning import get_reasoning_format
from dspark.chat.special_tags import kept_tag_ids
from dspark.chat.tool_parsers import get_tool_parser
from dspark.engine.output import fan_out
from dspark.generation_config import apply_defaults
from dspark.request import InvalidRequest
from dspark.server import responses, serving
from dspark.server.async_engine import AdmissionError, RequestFault, RequestStream
from dspark.server.choices import Output
from dspark.server.config import ServerConfig
from dspark.server.disconnect import unless_disconnected
from dspark.server.logprobs import LogprobFormatter
from dspark.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard,
                                    ModelList, TokenizeRequest)
from dspark.server.responses_protocol import ResponsesRequest
from dspark.server.serving import APIError, bad_request
from dspark.server.streams import PrimedStream
from dspark.server.tokenize import detokenize as detokenize_ids
from dspark.server.tokenize import tokenize as tokenize_ids
from dspark.server.tools import strict_check, tool_schemas
from dspark.utils.host import trim_heap

log = logging.getLogger(__name__)
# a whole response this large (an echo with prompt logprobs: megabytes of JSON from far more Python objects) trims
# the heap once it is sent, so the objects' memory goes back to the OS (`utils.host.trim_heap`)
LARGE_RESPONSE_BYTES = 1 << 20


@dataclass(frozen=True)
class Settings:
    """What the routes read besides the engine, fixed when the app is built (`Settings.of`)."""

    names: tuple[str, ...]  # the served model names; responses carry the first
    tokenizer: Any = None
    config: ServerConfig = field(default_factory=ServerConfig)
    model_root: str | None = None  # the model the engine loaded (/v1/models' `root`)
    defaults: dict = field(default_factory=dict)  # the model's generation_config.json sampling defaults
    tool_parser: Any = None  # --tool-call-parser's format
    reasoning: Any = None  # --reasoning-parser's format
    kept_tags: tuple[int, ...] = ()  # the parsers' tags, decoded for them

    @property
    def model_name(self) -> str:
        return self.names[0]

    @property
    def retry_after(self) -> dict:
        return {"Retry-After": str(self.config.retry_after_s)}

    @classmethod
    def of(cls, config: ServerConfig, names: tuple[str, ...], tokenizer, engine_config=None) -> "Settings":
        defaults = {}
        if engine_config is not None:
            from dspark.generation_config import sampling_defaults
            defaults = sampling_defaults(engine_config.generation_config, engine_config.model)
        tool_parser = None if config.tool_call_parser is None else get_tool_parser(config.tool_call_parser)
        reasoning = None if config.reasoning_parser is None else get_reasoning_format(config.reasoning_parser)
        return cls(names=names, tokenizer=tokenizer, config=config,
                   model_root=getattr(engine_config, "model", None), defaults=defaults, tool_parser=tool_parser,
                   reasoning=reasoning, kept_tags=kept_tag_ids(tokenizer, reasoning, tool_parser))


def get_engine(request: Request):
    return request.app.state.engine


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


Engine = Annotated[Any, Depends(get_engine)]  # AsyncEngine | ReplicaSet
Served = Annotated[Settings, Depends(get_settings)]
router = APIRouter()


# -- helpers ---------------------------------------------------------------------------------------
def check_model(settings: Settings, name: str | None) -> None:
    if name is not None and name not in settings.names:
        served = ", ".join(f"`{n}`" for n in settings.names)
        raise APIError(404, f"The model `{name}` does not exist. Served: {served}.",
                       type="not_found_error", param="model")


def refusal(settings: Settings, e: AdmissionError) -> APIError:
    kind = "rate_limit_error" if e.status_code == 429 else "service_unavailable"
    return APIError(e.status_code, str(e), type=kind, headers=settings.retry_after)


def admit(engine, settings: Settings) -> None:
    """Refuse before tokenizing when the request could not be admitted anyway."""
    try:
        engine.check_admission()
    except AdmissionError as e:
        raise refusal(settings, e) from None
    except RuntimeError as e:
        raise APIError(503, str(e), type="service_unavailable") from None


def validate(engine, prompt_ids: list[int], params) -> None:
    """The engine's one check of a request (`request.check_request`), as a 400 naming the field."""
    try:
        engine.check_request(prompt_ids, params)
    except InvalidRequest as e:
        raise bad_request(str(e), param=e.param) from None


async def add(engine, settings: Settings, requests: list[tuple[list[int], object, str]],
              client: str) -> list[RequestStream]:
    """Engine requests of one HTTP request (`client`: they take admission turns with other clients'), added in one
    go; the error of one refused as its HTTP error."""
    try:
        return await engine.add_requests(requests, client=client)
    except AdmissionError as e:
        raise refusal(settings, e) from None
    except RequestFault as e:
        raise APIError(500, str(e), type="internal_error") from None
    except InvalidRequest as e:
        raise bad_request(str(e), param=e.param) from None
    except ValueError as e:
        raise bad_request(str(e)) from None
    except RuntimeError as e:
        raise APIError(503, str(e), type="service_unavailable") from None


async def start(engine, settings: Settings, prompts: list[list[int]], params,
                prefix: str = "cmpl") -> list[RequestStream]:
    """The engine requests of one HTTP request's prompts (a completions batch, or a chat's one prompt), n choices
    each, streams in prompt order (index = prompt * n + choice). Every prompt's first choice goes in at once;
    choice i > 0 of a prompt (`<id>-<i>`, seeded with seed + i) once its first choice has emitted, so they share
    its prompt's KV through the prefix cache. Ids are `cmpl-...`, chat's `chatcmpl-...` (OpenAI's and vLLM's), a
    response's `resp-...`; all of them are one client's for admission turns. The prompts are validated already."""
    subs = fan_out(params, params.n)
    bases = [f"{prefix}-{uuid.uuid4().hex}" for _ in prompts]
    if settings.config.enable_log_requests:
        log.info("request %s: %d prompt(s) of %s tokens, %s", bases[0], len(prompts),
                 ", ".join(str(len(ids)) for ids in prompts[:8]), params)
    firsts = await add(engine, settings, [(ids, subs[0], base) for ids, base in zip(prompts, bases)], bases[0])
    if params.n == 1:
        return firsts
    groups: list[list[RequestStream]] = [[s] for s in firsts]

    async def the_others(k: int) -> None:
        groups[k][0] = await PrimedStream.after_first(firsts[k])  # its prompt blocks are in the prefix cache
        groups[k] += await add(engine, settings, [(prompts[k], sub, f"{bases[k]}-{i}")
                                                  for i, sub in enumerate(subs[1:], 1)], bases[0])
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


async def respond(request: Request, settings: Settings, body, streams, shape, outputs,
                  choices_per_prompt: int | None = None):
    if body.stream:
        opts = body.stream_options
        return StreamingResponse(
            serving.stream_response(
                streams, shape, model=settings.model_name, include_usage=bool(opts and opts.include_usage),
                continuous_usage=bool(opts and opts.continuous_usage_stats), outputs=outputs,
                choices_per_prompt=choices_per_prompt),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    result = await unless_disconnected(serving.collect_response(
        streams, shape, model=settings.model_name, is_disconnected=request.is_disconnected,
        outputs=outputs, choices_per_prompt=choices_per_prompt), request.is_disconnected)
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    response = JSONResponse(result.model_dump())
    if len(response.body) >= LARGE_RESPONSE_BYTES:  # its objects are freed by the time it is sent: return
        response.background = BackgroundTask(trim_heap)  # their memory then (a thread), not at the next idle
    return response


async def chat_streams(engine, settings: Settings, body: ChatCompletionRequest, request: Request,
                       prefix: str = "chatcmpl"):
    """A validated chat request started: (params, streams, outputs), one per choice; None when the client left
    while they were being added (all of them aborted). /v1/chat/completions and /v1/responses both start here, so
    prompt rendering, sampling, tool and reasoning parsing and structured output are one path."""
    tokenizer, reasoning, auto_tools = settings.tokenizer, settings.reasoning, settings.config.enable_auto_tool_choice
    marker = serving.call_marker(body, settings.tool_parser)
    params = apply_defaults(serving.sampling_params(body, serving.chat_max_tokens(body), tokenizer,
                                                    auto_tools=auto_tools, reasoning=reasoning, call_start=marker,
                                                    kept_special_ids=settings.kept_tags),
                            body, settings.defaults)
    admit(engine, settings)
    trusted = settings.config.trust_request_chat_template
    if trusted and serving.request_template(body) is not None:  # rendered in a child: wait off the loop
        prompt_ids = await asyncio.to_thread(serving.chat_prompt_ids, body, tokenizer, trust_request_template=True)
    else:
        prompt_ids = serving.chat_prompt_ids(body, tokenizer, trust_request_template=trusted)
    mode = serving.tool_mode(body, auto_tools=auto_tools)
    parser = settings.tool_parser if serving.parses_tool_calls(body, auto_tools) else None
    phase = None if reasoning is None else reasoning.prompt_phase(tokenizer.decode(prompt_ids))
    tools = tool_schemas(body) if parser is not None else None  # checked by sampling_params above
    outputs = [Output(logprobs=None if params.logprobs is None else LogprobFormatter(tokenizer, chat=True),
                      tool_mode=mode, tool_parser=parser, tool_accept=strict_check(body), tools=tools,
                      reasoning=None if reasoning is None else
                      reasoning.stream(phase, marker, keep_call_start=mode is None),
                      prompt_logprobs=None if body.prompt_logprobs is None else
                      LogprobFormatter(tokenizer, chat=True, top_k=body.prompt_logprobs))
               for _ in range(params.n)]
    validate(engine, prompt_ids, params)
    streams = await unless_disconnected(start(engine, settings, [prompt_ids], params, prefix), request.is_disconnected)
    return None if streams is None else (params, streams, outputs)


# -- routes ----------------------------------------------------------------------------------------
@router.get("/health")
async def health(engine: Engine):
    stats = engine.stats()
    if not stats.healthy:
        raise APIError(503, f"engine is not running: {stats.error or 'not started'}", type="service_unavailable")
    return stats.health


@router.get("/get_load")
async def get_load(engine: Engine):
    """The routers' load probe (vllm-router's and sglang-router's power_of_two read `load`): requests running and
    waiting."""
    stats = engine.stats()
    running, waiting = stats.num_running, stats.num_queued
    return {"load": running + waiting, "num_reqs": running, "num_waiting_reqs": waiting}


@router.get("/metrics")
async def prometheus_metrics(engine: Engine):
    return Response(await engine.metrics.render_async(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(engine: Engine, settings: Served):
    cards = [ModelCard(id=n, root=settings.model_root, max_model_len=engine.max_model_len) for n in settings.names]
    return ModelList(data=cards).model_dump()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, engine: Engine, settings: Served):
    check_model(settings, body.model)
    tokenizer = settings.tokenizer
    params = apply_defaults(serving.sampling_params(body, body.max_tokens, tokenizer), body, settings.defaults)
    admit(engine, settings)
    prompts = serving.completion_prompts(body, tokenizer)
    for ids, _ in prompts:  # every prompt checked before any starts
        validate(engine, ids, params)
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
    streams = await unless_disconnected(start(engine, settings, [ids for ids, _ in prompts], params),
                                        request.is_disconnected)
    if streams is None:  # the client left while its choices were being added: all of them aborted
        return Response(status_code=499)
    return await respond(request, settings, body, streams, serving.COMPLETION, outputs, choices_per_prompt=params.n)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, engine: Engine, settings: Served):
    check_model(settings, body.model)
    started = await chat_streams(engine, settings, body, request)
    if started is None:  # the client left while its choices were being added: all of them aborted
        return Response(status_code=499)
    _, streams, outputs = started
    return await respond(request, settings, body, streams, serving.CHAT, outputs)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, engine: Engine, settings: Served):
    check_model(settings, body.model)
    with responses.responses_fields():  # an error of the chat path names the Responses field
        started = await chat_streams(engine, settings, responses.chat_request(body), request, "resp")
    if started is None:
        return Response(status_code=499)
    params, (stream,), (output,) = started
    return await responses.respond(request, body, params, stream, output, model=settings.model_name,
                                   tokenizer=settings.tokenizer)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, engine: Engine, settings: Served):
    check_model(settings, body.model)
    return tokenize_ids(body, settings.tokenizer, max_model_len=engine.max_model_len)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, settings: Served):
    check_model(settings, body.model)
    return detokenize_ids(body, settings.tokenizer)


@router.get("/version")
async def version():
    from dspark import __version__
    return {"version": __version__}
