"""Async load generator for any OpenAI-compatible streaming server (behind `dspark bench serve`).

It sends each prompt to `/v1/chat/completions` (or `/v1/completions`) with `stream: true` and
`stream_options: {"include_usage": true}`, and records per request the send time, the arrival time
and token count of every content chunk, the final `usage`, and any error text.

Tokens per content chunk, first rule that applies:
1. the chunk's choice carries a non-standard `"num_tokens"` (dspark sends it; one chunk carries
   several tokens when speculative decoding accepts drafts);
2. the chunk carries `usage` (vLLM's continuous usage stats): the increase in `completion_tokens`;
3. otherwise 1.
A request's output token count is the final `usage.completion_tokens` when the server reports it,
else the sum over its chunks.

Load shape: arrivals are a gamma process with rate `request_rate` and shape `burstiness`
(burstiness 1 = Poisson, below 1 burstier, above 1 more regular; `inf` rate = all at t=0); at most
`max_concurrency` requests are in flight (a request that arrives while the limit is reached waits,
and its send time is when it is actually sent). `num_warmup` requests run first and are discarded.

Times in `RequestRecord` are seconds since the start of the measured run (`time.perf_counter`).
Not run directly: see `dspark.bench.cli` (`python -m dspark.bench.cli serve --help`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from dspark.bench.datasets import BenchPrompt


@dataclass(frozen=True)
class BenchConfig:
    """Everything `run_bench` needs; CLI flags are these names in kebab case."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id listed by /v1/models
    endpoint: str = "chat"  # chat | completions
    dataset: str = "gsm8k"  # see dspark.bench.datasets
    num_prompts: int = 100
    max_tokens: int = 256
    ignore_eos: bool = False  # True: fixed output length of max_tokens; False: natural stop
    max_concurrency: int | None = None  # None: unbounded
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times (1.0 = Poisson)
    num_warmup: int = 1
    seed: int = 0
    # measured prompts: [prompt_offset, prompt_offset + num_prompts) of the seed's shuffled order; the
    # warm-up takes the num_warmup after them, so no measured prompt was served before (a server's
    # prefix cache and cross-request lookup cache never saw it)
    prompt_offset: int = 0
    result_file: str | None = None
    api_key: str | None = None
    temperature: float = 0.0
    random_input_len: int = 128  # words per prompt, dataset "random" only
    request_timeout_s: float = 600.0
    progress: bool = True
    label: str = ""  # method name carried into results, for sweep plots and tables

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")
        if self.burstiness <= 0 or self.request_rate <= 0:
            raise ValueError("burstiness and request_rate must be > 0")
        if self.prompt_offset < 0:
            raise ValueError(f"prompt_offset must be >= 0, got {self.prompt_offset}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1 (or None for unbounded)")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request. Times: seconds since the measured run started."""

    request_index: int
    prompt_source: str
    send_s: float
    end_s: float  # when the response stream ended ([DONE] or close) or the error surfaced
    chunk_arrival_s: tuple[float, ...]  # one per content chunk
    chunk_num_tokens: tuple[int, ...]  # tokens in each content chunk
    num_prompt_tokens: int | None  # from usage; None if not reported
    num_output_tokens: int  # usage.completion_tokens if reported, else sum(chunk_num_tokens)
    usage_reported: bool
    finish_reason: str | None
    error: str = ""  # "" on success

    @property
    def success(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class RunOutput:
    """The raw result of one benchmark run, before metrics are computed."""

    model: str
    records: tuple[RequestRecord, ...]
    wall_time_s: float  # perf_counter around the measured run (warm-up and /metrics excluded)
    metrics_before_text: str | None  # Prometheus exposition text, None if /metrics was unavailable
    metrics_after_text: str | None


@dataclass
class _StreamState:
    chunk_arrival_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)
    last_completion_tokens: int = 0
    num_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str = ""


def server_root(base_url: str) -> str:
    """`http://host:port` from a base URL given with or without a trailing `/v1`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_payload(cfg: BenchConfig, model: str, prompt: str) -> dict:
    """The JSON body of one streaming request."""
    payload: dict = {"model": model}
    if cfg.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    payload.update(
        max_tokens=cfg.max_tokens, temperature=cfg.temperature, stream=True,
        stream_options={"include_usage": True},
    )
    if cfg.ignore_eos:  # vLLM / dspark extension; omitted otherwise, for strict servers
        payload["ignore_eos"] = True
    return payload


def _consume_chunk(chunk: dict, arrival_s: float, state: _StreamState) -> None:
    if "error" in chunk:
        state.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
        return
    usage = chunk.get("usage") or None
    choices = chunk.get("choices") or []
    text, num_tokens = "", None
    if choices:
        choice = choices[0]
        delta = choice.get("delta") or {}
        text = (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or choice.get("text") or "")
        num_tokens = choice.get("num_tokens")
        state.finish_reason = choice.get("finish_reason") or state.finish_reason
    if usage and usage.get("completion_tokens") is not None:
        completion_tokens = int(usage["completion_tokens"])
        usage_delta = completion_tokens - state.last_completion_tokens
        state.last_completion_tokens = completion_tokens
        state.usage_completion_tokens = completion_tokens
    else:
        usage_delta = None
    if usage and usage.get("prompt_tokens") is not None:
        state.num_prompt_tokens = int(usage["prompt_tokens"])
    if num_tokens is not None:
        tokens = int(num_tokens)
    elif usage_delta is not None and choices:
        tokens = usage_delta
    else:
        tokens = 1 if text else 0
    if text or tokens > 0:
        state.chunk_arrival_s.append(arrival_s)
        state.chunk_num_tokens.append(tokens)


async def send_request(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt: BenchPrompt,
    request_index: int, t0: float,
) -> RequestRecord:
    """Send one streaming request and record what arrives, with times relative to `t0`."""
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    url = server_root(cfg.base_url) + path
    state = _StreamState()
    send = time.perf_counter()
    try:
        async with client.stream("POST", url, json=build_payload(cfg, model, prompt.prompt),
                                 headers=_headers(cfg.api_key)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                state.error = f"HTTP {resp.status_code}: {body[:500]}"
            else:
                async for line in resp.aiter_lines():
                    arrival = time.perf_counter()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    _consume_chunk(json.loads(data), arrival - t0, state)
                    if state.error:
                        break
    except Exception as exc:  # noqa: BLE001 - any failure is recorded on the request, not raised
        state.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    if not state.error and not state.chunk_arrival_s:
        state.error = "no content chunks in the response stream"
    usage_reported = state.usage_completion_tokens is not None
    return RequestRecord(
        request_index=request_index, prompt_source=prompt.source,
        send_s=send - t0, end_s=end - t0,
        chunk_arrival_s=tuple(state.chunk_arrival_s),
        chunk_num_tokens=tuple(state.chunk_num_tokens),
        num_prompt_tokens=state.num_prompt_tokens,
        num_output_tokens=(state.usage_completion_tokens if usage_reported
                           else sum(state.chunk_num_tokens)),
        usage_reported=usage_reported, finish_reason=state.finish_reason, error=state.error,
    )


def arrival_offsets_s(num_requests: int, request_rate: float, burstiness: float,
                      seed: int) -> np.ndarray:
    """Send offsets from the run start: 0 for the first, then gamma-distributed gaps."""
    if math.isinf(request_rate) or num_requests == 0:
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                       size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps_s)])


async def _run_requests(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompts: list[BenchPrompt],
    offsets_s: np.ndarray, max_concurrency: int | None, desc: str,
) -> tuple[list[RequestRecord], float]:
    from tqdm import tqdm

    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(prompts), desc=desc, disable=not cfg.progress, leave=False)
    t0 = time.perf_counter()

    async def one(index: int, prompt: BenchPrompt, offset_s: float) -> RequestRecord:
        delay_s = t0 + offset_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        async with semaphore if semaphore else contextlib.nullcontext():
            record = await send_request(client, cfg, model, prompt, index, t0)
        progress.update(1)
        return record

    records = await asyncio.gather(*(one(i, p, float(o)) for i, (p, o)
                                     in enumerate(zip(prompts, offsets_s))))
    wall_time_s = time.perf_counter() - t0
    progress.close()
    return list(records), wall_time_s


async def fetch_first_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str:
    resp = await client.get(server_root(cfg.base_url) + "/v1/models", headers=_headers(cfg.api_key))
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{cfg.base_url}/v1/models lists no models; pass --model")
    return data[0]["id"]


async def fetch_metrics_text(client: httpx.AsyncClient, cfg: BenchConfig) -> str | None:
    """The server's Prometheus exposition text, or None if it has no /metrics."""
    try:
        resp = await client.get(server_root(cfg.base_url) + "/metrics",
                                headers=_headers(cfg.api_key))
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


async def run_load(cfg: BenchConfig, prompts: list[BenchPrompt],
                   warmup_prompts: list[BenchPrompt] | None = None) -> RunOutput:
    """Warm up (on `warmup_prompts`, else on the first measured ones), snapshot /metrics, run the
    measured requests, snapshot /metrics again."""
    num_connections = max(cfg.max_concurrency or len(prompts), cfg.num_warmup, 1)
    limits = httpx.Limits(max_connections=num_connections,
                          max_keepalive_connections=num_connections)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
    # trust_env=False: proxy variables must not reroute requests meant for a local server.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = cfg.model or await fetch_first_model(client, cfg)
        if cfg.num_warmup > 0:
            pool = warmup_prompts or prompts
            warmup = [pool[i % len(pool)] for i in range(cfg.num_warmup)]
            warm_records, _ = await _run_requests(
                client, cfg, model, warmup, np.zeros(len(warmup)), cfg.max_concurrency, "warm-up")
            failed = [r for r in warm_records if not r.success]
            if failed:
                raise RuntimeError(f"warm-up request failed: {failed[0].error}")
        before = await fetch_metrics_text(client, cfg)
        offsets_s = arrival_offsets_s(len(prompts), cfg.request_rate, cfg.burstiness, cfg.seed)
        records, wall_time_s = await _run_requests(
            client, cfg, model, prompts, offsets_s, cfg.max_concurrency, "bench")
        after = await fetch_metrics_text(client, cfg)
    return RunOutput(model, tuple(records), wall_time_s, before, after)
