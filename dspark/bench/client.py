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
from dspark.utils.options import opt


def _optional_int(text: str) -> int | None:
    return None if str(text).lower() in ("none", "0", "inf", "unbounded") else int(text)


ENDPOINTS = {"chat": "chat", "/v1/chat/completions": "chat", "completions": "completions",
             "/v1/completions": "completions"}
BACKENDS = {"openai-chat": "chat", "openai": "completions", "vllm": "completions"}  # vLLM's --backend


@dataclass(frozen=True)
class BenchConfig:
    """Everything `run_bench` needs; `dspark bench serve`'s flags are generated from these fields
    (`dspark.engine_args`), in `vllm bench serve`'s spellings where it has the option."""

    base_url: str | None = opt(None, "the server (with or without /v1; default http://HOST:PORT)")
    host: str = opt("127.0.0.1", "the server's host, when --base-url is not given")
    port: int = opt(8000, "the server's port, when --base-url is not given")
    model: str | None = opt(None, "model name to send (default: the first id of /v1/models)")
    backend: str | None = opt(None, "vLLM's backend names: openai-chat (the chat endpoint), openai / vllm "
                              "(completions); sets the endpoint when --endpoint is not given",
                              choices=tuple(BACKENDS))
    endpoint: str | None = opt(None, "chat | completions, or the path /v1/chat/completions | /v1/completions "
                               "(default: chat)", choices=tuple(ENDPOINTS))
    # see dspark.bench.datasets
    dataset: str = opt("gsm8k", "random | sharegpt | custom (--dataset-path) | a prompt set: gsm8k, math500, "
                       "humaneval, mbpp, livecodebench, mt-bench | math | code | chat | all | PATH.jsonl",
                       flag="--dataset-name", aliases=("--dataset",))
    dataset_path: str | None = opt(None, "the file of --dataset-name sharegpt (JSON) or custom (JSONL)")
    num_prompts: int = opt(100, "measured requests")
    max_tokens: int = opt(256, "max_tokens of each request (the random / sharegpt / custom output lengths "
                          "override it)")
    random_input_len: int = opt(128, "dataset random: prompt tokens (counted by the server's /tokenize)")
    random_output_len: int | None = opt(None, "dataset random: max_tokens of each request")
    random_range_ratio: float = opt(0.0, "dataset random: lengths drawn from [len*(1-r), len*(1+r)]")
    sharegpt_output_len: int | None = opt(None, "dataset sharegpt: max_tokens of each request")
    custom_output_len: int | None = opt(None, "dataset custom: max_tokens of each request")
    # True: fixed output length of max_tokens; False: natural stop
    ignore_eos: bool = opt(False, "fixed output length: always max_tokens", negatives=("--natural-stop",))
    max_concurrency: int | None = opt(None, "max requests in flight (default: unbounded)", parse=_optional_int)
    request_rate: float = opt(math.inf, "requests/s, gamma arrivals (default inf: all at once)")
    burstiness: float = opt(1.0, "gamma shape of inter-arrival times; 1 = Poisson")
    num_warmup: int = opt(1, "warm-up requests, not measured", flag="--num-warmups", aliases=("--num-warmup",))
    seed: int = opt(0, "prompt order and arrivals")
    # measured prompts: [prompt_offset, prompt_offset + num_prompts) of the seed's shuffled order; the
    # warm-up takes the num_warmup after them, so no measured prompt was served before (a server's
    # prefix cache and cross-request lookup cache never saw it)
    prompt_offset: int = opt(0, "skip this many prompts of the seed's order (the warm-up takes the ones "
                             "after the measured prompts)")
    percentile_metrics: str = opt("ttft,tpot,itl,e2el", "latencies reported (comma list of ttft, tpot, itl, e2el)")
    metric_percentiles: str = opt("90,99", "percentiles reported (comma list)")
    goodput: tuple[str, ...] = opt((), "SLOs as KEY:MS (ttft, tpot, e2el): request_goodput counts the "
                                   "requests meeting all of them")
    extra_body: str | None = opt(None, "a JSON object merged into every request body")
    save_result: bool = opt(False, "write the result JSON (to --result-dir / --result-filename)")
    result_dir: str | None = opt(None, "folder of --save-result (default: the current one)")
    result_filename: str | None = opt(None, "file name of --save-result (default: vLLM's pattern)")
    result_file: str | None = opt(None, "write the full result (per-request records too) to this path")
    api_key: str | None = opt(None, "sent as 'Authorization: Bearer KEY'")
    temperature: float = opt(0.0, "sampling temperature of every request")
    request_timeout_s: float = opt(600.0, "per-request client timeout")
    disable_tqdm: bool = opt(False, "no progress bar")
    label: str = opt("", "method name carried into results, for sweep plots and tables")

    def __post_init__(self) -> None:
        if self.endpoint is None:
            object.__setattr__(self, "endpoint", BACKENDS.get(self.backend or "", "chat"))
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be chat, completions, /v1/chat/completions or /v1/completions, "
                             f"got {self.endpoint!r}")
        object.__setattr__(self, "endpoint", ENDPOINTS[self.endpoint])
        if self.base_url is None:
            object.__setattr__(self, "base_url", f"http://{self.host}:{self.port}")
        if self.burstiness <= 0 or self.request_rate <= 0:
            raise ValueError("burstiness and request_rate must be > 0")
        if self.prompt_offset < 0:
            raise ValueError(f"prompt_offset must be >= 0, got {self.prompt_offset}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1 (or None for unbounded)")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        bad = set(self.metrics) - {"ttft", "tpot", "itl", "e2el"}
        if bad:
            raise ValueError(f"percentile_metrics: unknown {', '.join(sorted(bad))}; use ttft, tpot, itl, e2el")
        self.percentiles  # noqa: B018 - parses them (ValueError for a bad list)
        if self.extra_body is not None and not isinstance(json.loads(self.extra_body), dict):
            raise ValueError("extra_body must be a JSON object")

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(x.strip() for x in self.percentile_metrics.split(",") if x.strip())

    @property
    def percentiles(self) -> tuple[float, ...]:
        values = tuple(float(x) for x in self.metric_percentiles.split(",") if x.strip())
        if not all(0 < p < 100 for p in values):
            raise ValueError(f"metric_percentiles must lie in (0, 100), got {self.metric_percentiles!r}")
        return values

    @property
    def progress(self) -> bool:
        return not self.disable_tqdm


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
    if cfg.extra_body:
        payload.update(json.loads(cfg.extra_body))
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
