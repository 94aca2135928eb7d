"""LLM: the offline API, in vLLM's shape. Adds requests, loops `Engine.step()`, detokenizes; no
scheduling logic.

    from dspark import LLM, SamplingParams
    llm = LLM(model="SmolLM2-135M-Instruct", max_model_len=4096,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = llm.generate(["The capital of France is", {"prompt_token_ids": [1, 504, 3458]}],
                        sampling_params=SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text, outs[0].finished, outs[0].metrics.first_token_latency)
    llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32))

Engine arguments are vLLM's names (and dspark's aliases), generated from the config dataclasses
(`dspark.engine_args.config_from_kwargs`); an unknown or unsupported one is a TypeError naming it.
Prompts: a string, a list of token ids, `{"prompt": str}`, `{"prompt_token_ids": [...]}`, or a list of
these. `SamplingParams()` left out: the model's generation_config.json defaults (`generation_config`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dspark.config import DEFAULT_MODEL, EngineConfig
from dspark.detokenizer import StreamState
from dspark.engine.output import OutputProcessor, fan_out
from dspark.request import SpecStats
from dspark.sampling import SamplingParams, TokenLogprob

PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # per token, when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it, if one did
    # LLM.chat(..., reasoning_parser=, tool_parser=): the thoughts apart, the answer's parsed calls
    # (`dspark.chat.tool_parsers.ParsedCall`); `text` stays the whole output
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list | None = None


@dataclass
class RequestMetrics:
    """Times (time.time() seconds) of one request, as vLLM's RequestOutput.metrics."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def first_token_latency(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    spec: SpecStats = field(default_factory=SpecStats)  # dspark: speculative-decoding counts
    ttft_s: float = 0.0  # dspark: seconds from the call to this request's first token
    e2e_s: float = 0.0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, config: EngineConfig | None = None, engine=None,
                 tokenizer=None, **engine_args: Any):
        if engine is not None:  # tests inject a prebuilt engine (tiny random models)
            if engine_args:
                raise TypeError(f"LLM(engine=...) takes no engine arguments, got {', '.join(sorted(engine_args))}")
            self.engine, self.tokenizer = engine, tokenizer
        else:
            if config is None:
                from dspark.engine_args import config_from_kwargs
                config = config_from_kwargs(EngineConfig, {"model": model, **engine_args}, caller="LLM()")
            elif engine_args:
                raise TypeError(f"LLM(config=...) takes no other engine arguments, got "
                                f"{', '.join(sorted(engine_args))}")
            from dspark.engine.build import build_engine
            self.engine, self.tokenizer = build_engine(config)
        self._default_params: SamplingParams | None = None
        self._hf_tokenizer = None

    # -- public API ------------------------------------------------------------------------------
    def get_tokenizer(self):
        """The transformers tokenizer the engine's prompts are encoded with (a cached GGUF tokenizer, which the
        engine reads without transformers, is built as transformers' on the first call)."""
        if self.tokenizer is None:
            return None
        if self._hf_tokenizer is None:
            from dspark.models.tokenizer import as_transformers
            self._hf_tokenizer = as_transformers(self.tokenizer.tokenizer)
        return self._hf_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (`generation_config`)."""
        if self._default_params is None:
            from dspark.generation_config import sampling_defaults
            config = self.engine.config
            self._default_params = SamplingParams(**sampling_defaults(config.generation_config, config.model))
        return self._default_params

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order (prompt forms: the module docstring)."""
        items = _prompt_list(prompts)
        prompt_ids, texts = [], []
        for item in items:
            text, ids = _parse_prompt(item)
            if ids is None:
                ids = self.tokenizer.encode(text)
            prompt_ids.append(list(ids))
            texts.append(text)
        return self._run(prompt_ids, texts, sampling_params, use_tqdm=use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             reasoning_parser: str | None = None, tool_parser: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each rendered by the chat template
        (`chat_template` instead of the model's), then generated. `reasoning_parser` / `tool_parser` (the
        server's `--reasoning-parser` / `--tool-call-parser` names) fill each output's `reasoning_content`,
        `content` and `tool_calls`; with a reasoning parser a structured output applies after the thoughts."""
        from dspark.chat.reasoning import get_reasoning_format
        from dspark.chat.tool_parsers import get_tool_parser
        reasoning = None if reasoning_parser is None else get_reasoning_format(reasoning_parser)
        calls = None if tool_parser is None else get_tool_parser(tool_parser)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # vLLM: continuing the last message adds no new turn
        options = {"chat_template": chat_template, "continue_final_message": continue_final_message or None,
                   "tools": tools, **(chat_template_kwargs or {})}
        options = {k: v for k, v in options.items() if v is not None}
        prompt_ids = [self.tokenizer.apply_chat_template([_text_message(m) for m in conversation],
                                                         add_generation_prompt=add_generation_prompt, **options)
                      for conversation in conversations]
        # a call opened while thinking ends the thoughts; the tools' parameters type the calls' values
        marker = (calls.call_start or "") if calls is not None and tools else ""
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                   for t in tools or [] if isinstance(t, dict) and "function" in t}
        if reasoning is not None or calls is not None:
            sampling_params = self._for_parsers(sampling_params, reasoning, calls, len(prompt_ids), marker)
        outputs = self._run(prompt_ids, [None] * len(prompt_ids), sampling_params, use_tqdm=use_tqdm)
        if reasoning is not None or calls is not None:
            for ids, res in zip(prompt_ids, outputs):
                phase = None if reasoning is None else reasoning.prompt_phase(self.tokenizer.decode(ids))
                for out in res.outputs:
                    out.reasoning_content, out.content = (None, out.text) if reasoning is None else \
                        reasoning.split(out.text, phase, marker)
                    if calls is not None:
                        parsed = calls.parse(out.content or "", tools=schemas if tools else None)
                        out.content, out.tool_calls = (parsed.content, parsed.calls) if parsed.calls else \
                            (out.content, [])
        return outputs

    def _for_parsers(self, params, fmt, calls, n: int, call_start: str = ""):
        """The SamplingParams with the parsers' special tags kept in the text, and the reasoning tags as token ids
        where a structured output is asked."""
        from dspark.chat.special_tags import kept_tag_ids
        tags = None if fmt is None else fmt.tags(self.tokenizer, call_start)
        kept = kept_tag_ids(self.tokenizer, fmt, calls)
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.get_default_sampling_params()] * n
        return [dataclasses.replace(p, kept_special_ids=kept, **(
            {"reasoning_tags": tags} if tags is not None and p.structured_outputs is not None else {}))
                for p in params]

    # -- loop ------------------------------------------------------------------------------------
    def _run(self, prompt_ids, texts, params, *, use_tqdm) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.get_default_sampling_params()] * len(prompt_ids)
        if len(params) != len(prompt_ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_ids)} prompts")
        engine = self.engine
        # each engine request's one record: its text so far, its RequestOutput and choice, its kept logprobs
        output: OutputProcessor[_Slot] = OutputProcessor(self.tokenizer.tokenizer if self.tokenizer else None)
        order, failed = [], {}
        start, wall = time.perf_counter(), time.time()
        for ids, text, p in zip(prompt_ids, texts, params):
            n = getattr(p, "n", 1)
            res = RequestOutput("", text, list(ids), [CompletionOutput(i, "", [], None) for i in range(n)],
                                metrics=RequestMetrics(arrival_time=wall))
            for i, sub in enumerate(fan_out(p, n)):
                rid = engine.add_request(ids, sub)
                res.request_id = res.request_id or rid
                output.add(rid, sub, _Slot(StreamState.for_params(sub), res, i,
                                           [] if sub.logprobs is not None else None))
            order.append(res)
        bar = _progress(len(order), use_tqdm)
        while engine.has_unfinished():
            deltas, aborts = output.process(engine.step())
            for rid in aborts:  # a stop string (or a fault of its own) ended it here
                engine.abort(rid)
            for delta in deltas:
                out, slot = delta.output, delta.record
                res, i = slot.result, slot.index
                if delta.error is not None:  # non-finite target logits (dspark.engine.faults)
                    failed[delta.request_id] = delta.error
                if delta.num_kept and res.metrics.first_token_time is None:
                    res.ttft_s = time.perf_counter() - start
                    res.metrics.first_token_time = time.time()
                if delta.num_kept:
                    res.metrics.last_token_time = time.time()
                if slot.logprobs is not None:
                    slot.logprobs += delta.logprobs or []
                res.num_cached_tokens, res.spec = out.num_cached_tokens, out.spec
                if out.prompt_logprobs is not None and res.prompt_logprobs is None:  # n > 1: one prompt
                    res.prompt_logprobs = out.prompt_logprobs
                if delta.finished:
                    res.outputs[i] = CompletionOutput(i, delta.state.text, list(delta.state.token_ids),
                                                      delta.finish_reason, logprobs=slot.logprobs)
                    if all(o.finish_reason is not None for o in res.outputs):
                        res.finished = True
                        res.e2e_s = time.perf_counter() - start
                        res.metrics.finished_time = time.time()
                        res.metrics.num_generation_tokens = sum(len(o.token_ids) for o in res.outputs)
                        if bar:
                            bar.update(1)
        if bar:
            bar.close()
        if failed:  # never hand back garbage
            rid, why = next(iter(failed.items()))
            raise RuntimeError(f"{len(failed)} of {len(order)} requests failed ({rid}: {why})")
        return order


@dataclass
class _Slot:
    """One engine request of `LLM._run`: its text so far, the RequestOutput and choice it fills, its logprobs."""

    state: StreamState
    result: RequestOutput
    index: int
    logprobs: list[TokenLogprob] | None  # the kept tokens' so far, when it asked


def _prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _parse_prompt(item) -> tuple[str | None, list[int] | None]:
    """(text, ids) of one prompt; exactly one is None unless a dict gives both."""
    if isinstance(item, str):
        return item, None
    if isinstance(item, dict):
        unknown = sorted(set(item) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"prompt dict key(s) not supported: {', '.join(unknown)}; "
                             f"supported: {', '.join(PROMPT_KEYS)}")
        if "prompt_token_ids" in item:
            return item.get("prompt"), [int(t) for t in item["prompt_token_ids"]]
        if "prompt" in item:
            return item["prompt"], None
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(item, (list, tuple)) and all(isinstance(t, int) for t in item):
        return None, list(item)
    raise TypeError(f"a prompt must be a str, a list of token ids or a dict with 'prompt' / "
                    f"'prompt_token_ids'; got {type(item).__name__}")


def _text_message(message: dict) -> dict:
    """OpenAI content parts joined into one text (only text parts exist here)."""
    content = message.get("content")
    if isinstance(content, list):
        kinds = {part.get("type", "text") for part in content} - {"text"}
        if kinds:
            raise ValueError(f"only text content parts are supported, got {', '.join(sorted(kinds))}")
        message = {**message, "content": "\n".join(part.get("text") or "" for part in content)}
    return message


def _progress(total: int, use_tqdm):
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="generate", unit="req")
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="req")
