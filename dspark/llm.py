"""LLM: the offline API. Adds requests, loops `Engine.step()`, detokenizes. No scheduling logic.

    from dspark import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct, the embedded default
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from dspark.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpecConfig, DEFAULT_MODEL
from dspark.detokenizer import Detokenizer, StreamState
from dspark.request import SpecStats
from dspark.sampling import SamplingParams, TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # per token, when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    ttft_s: float = 0.0
    e2e_s: float = 0.0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, speculative_config: dict | str | None = None,
                 dtype: str = "auto", matmul_dtype: str = "auto", seed: int = 0, device: str = "auto",
                 tensor_parallel_size: int = 1, distributed_timeout_s: float = 120.0, enforce_eager: bool = False,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 max_model_len: int | None = None, kv_cache_memory_gb: float = 1.0,
                 num_kv_blocks: int | None = None, kv_block_size: int = 16,
                 enable_prefix_caching: bool = True, num_threads: int | None = None,
                 config: EngineConfig | None = None, engine=None, tokenizer=None):
        if engine is not None:  # tests inject a prebuilt engine (tiny random models)
            self.engine, self.tokenizer = engine, tokenizer
        else:
            spec = None if speculative_config is None else SpecConfig.from_dict(speculative_config)
            config = config or EngineConfig(
                model=model, dtype=dtype, matmul_dtype=matmul_dtype, seed=seed, num_threads=num_threads,
                device=device, enforce_eager=enforce_eager, parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                                       distributed_timeout_s=distributed_timeout_s),
                cache=CacheConfig(kv_block_size=kv_block_size, kv_cache_memory_gb=kv_cache_memory_gb,
                                  num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching),
                scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          max_model_len=max_model_len),
                spec=spec)
            from dspark.engine.build import build_engine
            self.engine, self.tokenizer = build_engine(config)
        self.detokenizer = Detokenizer(self.tokenizer.tokenizer) if self.tokenizer else None

    # -- public API ------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompt_ids = [p if not isinstance(p, str) else self.tokenizer.encode(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(prompt_ids, texts, params, use_tqdm=use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompt_ids = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                      for c in conversations]
        return self._run(prompt_ids, [None] * len(prompt_ids), params, use_tqdm=use_tqdm)

    # -- loop ------------------------------------------------------------------------------------
    def _run(self, prompt_ids, texts, params, *, use_tqdm: bool) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompt_ids)
        if len(params) != len(prompt_ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_ids)} prompts")
        engine = self.engine
        order, states, results = [], {}, {}
        choice: dict[str, tuple[str, int]] = {}  # engine request → (its RequestOutput, completion index)
        logprobs: dict[str, list[TokenLogprob]] = {}
        start = time.perf_counter()
        for ids, text, p in zip(prompt_ids, texts, params):
            rid = None
            for i in range(p.n):  # n completions: engine requests seeded seed + i
                sub = p if p.n == 1 else dataclasses.replace(
                    p, n=1, seed=None if p.seed is None else p.seed + i)
                eid = engine.add_request(ids, sub)
                rid = rid or eid
                choice[eid] = (rid, i)
                states[eid] = StreamState(stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)
                if p.logprobs is not None:
                    logprobs[eid] = []
            order.append(rid)
            results[rid] = RequestOutput(rid, text, list(ids), [CompletionOutput(i, "", [], None)
                                                                for i in range(p.n)])
        bar = _progress(len(order)) if use_tqdm else None
        reap = False  # an abort's finished output is reported (and dropped) by the next step
        while engine.has_unfinished() or reap:
            reap = False
            for out in engine.step():
                if out.request_id not in choice:
                    continue  # left over from an earlier call
                rid, index = choice[out.request_id]
                res, state = results[rid], states[out.request_id]
                if out.new_token_ids and not res.ttft_s:
                    res.ttft_s = time.perf_counter() - start
                if self.detokenizer is not None:
                    _, kept = self.detokenizer.feed(state, out.new_token_ids)
                    if state.stopped and not out.finished:
                        engine.abort(out.request_id, "stop")
                        reap = True
                else:
                    kept = len(out.new_token_ids)
                    state.token_ids.extend(out.new_token_ids)
                if out.request_id in logprobs:
                    logprobs[out.request_id] += (out.logprobs or [])[:kept]
                finished = out.finished or state.stopped
                res.num_cached_tokens = out.num_cached_tokens
                res.spec = out.spec
                if finished and res.outputs[index].finish_reason is None:
                    res.outputs[index] = CompletionOutput(
                        index, state.text, list(state.token_ids), "stop" if state.stopped else out.finish_reason,
                        logprobs.get(out.request_id))
                    res.e2e_s = time.perf_counter() - start
                    if bar and all(o.finish_reason for o in res.outputs):
                        bar.update(1)
        if bar:
            bar.close()
        failed = {rid: why for rid, why in engine.take_failed().items() if rid in results}
        if failed:  # non-finite target logits (dspark.engine.faults): never hand back garbage
            rid, why = next(iter(failed.items()))
            raise RuntimeError(f"{len(failed)} of {len(order)} requests failed ({rid}: {why})")
        return [results[rid] for rid in order]


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="req")
