"""Sampling parameters and the logits → probabilities → token path shared by the engine, the drafters
and the verifier.

`SamplingParams` validates itself on construction (bad values raise `ValueError` naming the field), so
the server can turn the error straight into an HTTP 400.

Greedy is a temperature below `GREEDY_EPS` (DeepSpec's convention); its probabilities are the one-hot
argmax, so rejection sampling against a greedy target reproduces greedy decoding exactly.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dspark import kernels

GREEDY_EPS = 1e-5


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] → [...] long: the index of each row's maximum, the first on ties (torch.argmax's
    answer). Through `max(dim).indices`, which torch computes faster than `argmax` on the CPU, or the CPU
    kernel's `row_argmax` (the same answer) for fp32 rows."""
    found = kernels.row_argmax(logits)
    return found[1] if found is not None else logits.max(dim=-1).indices


@dataclass(frozen=True)
class RowArgmax:
    """Each logits row's maximum and the index of its first occurrence: all that a step whose every request
    is greedy without logprobs or processors reads of the target's rows (`dspark.verify.sampler.
    argmax_suffices`). The vocabulary-parallel head merges it from its shards' winners without gathering
    the rows (dspark.distributed.vocab_argmax). A NaN anywhere in a row makes its value NaN, a +inf
    +inf, a row masked throughout -inf: the fault check reads the values as the rows themselves."""

    values: torch.Tensor  # [num_logits] float32
    indices: torch.Tensor  # [num_logits] long

    @classmethod
    def of(cls, logits: torch.Tensor) -> "RowArgmax":  # [num_logits, vocab] -> [num_logits] each
        found = kernels.row_argmax(logits)
        if found is not None:
            return cls(*found)
        top = logits.float().max(dim=-1)
        return cls(top.values, top.indices)

    def __len__(self) -> int:
        return self.values.shape[0]

    def clone(self) -> "RowArgmax":
        return RowArgmax(self.values.clone(), self.indices.clone())

    def __setitem__(self, rows, value: float) -> None:
        """Overwrite `rows` as if their logits rows were all `value`: maximum `value` at index 0."""
        self.values[rows] = value
        self.indices[rows] = 0


def target_argmax(logits: "torch.Tensor | RowArgmax") -> torch.Tensor:
    """[num_logits] long: each row's argmax (first on ties), from the rows or from a `RowArgmax`."""
    return logits.indices if isinstance(logits, RowArgmax) else greedy_ids(logits)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI / vLLM names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    max_tokens: int | None = 16  # None: up to the model's max length
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    include_stop_str_in_output: bool = False
    speculation: bool = True  # per-request opt-out of speculative decoding
    # logits processors (dspark/logits_processors.py), applied per position of a verify window
    presence_penalty: float = 0.0  # subtracted once from each token the output already holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # prompt and output tokens: positive logits divided, others multiplied
    min_p: float = 0.0  # drop tokens below min_p * the top probability (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is accepted
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    allowed_token_ids: tuple[int, ...] = ()  # when set, only these tokens
    logprobs: int | None = None  # None: none; k >= 0: the emitted token's logprob and the top k
    # None: none; k >= 0: each prompt token's logprob under the target's raw distribution at the position
    # before it (the first token has none) and the top k there (vLLM's prompt_logprobs)
    prompt_logprobs: int | None = None
    # structured output (dspark/structured.py): {"json": schema | "regex": str | "choice": [...] |
    # "grammar": lark | "json_object": True}; None: free text
    structured_outputs: dict | None = None
    # a thinking model's reasoning tags (`--reasoning-parser`): structured_outputs applies to the answer after
    # them, never to the thoughts (dspark.structured.AfterReasoning)
    reasoning_tags: "ReasoningTags | None" = None
    n: int = 1  # completions per prompt (LLM.generate / the server fan out n requests)
    # special tokens decoded into the text (the others are skipped): the reasoning and tool-call tags the
    # server's parsers read, where the tokenizer marks them special (Gemma 4's `<|tool_call>`, `<|channel>`)
    kept_special_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # normalising a user convenience, once
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        object.__setattr__(self, "bad_words", tuple(tuple(int(t) for t in w) for w in self.bad_words))
        object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        object.__setattr__(self, "kept_special_ids", tuple(int(t) for t in self.kept_special_ids))
        _check(_is_real(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
               f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(_is_int(self.top_k) and (self.top_k == -1 or 0 <= self.top_k <= MAX_INT32),
               f"top_k must be -1, 0 or a positive integer below 2**31, got {self.top_k}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32),
               f"max_tokens must be an integer in [1, 2**31), got {self.max_tokens}")
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64),
               f"seed must be an integer in [-2**63, 2**64), got {self.seed}")
        _check(all(0 <= t < 2**63 for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        _check(_is_real(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(_is_real(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        # at least MIN_REPETITION_PENALTY: a positive logit divided by a vanishing one overflows to +inf, and a
        # row with +inf has no distribution to sample from
        _check(_is_real(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10], got {self.repetition_penalty}")
        _check(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(all(math.isfinite(b) and -100.0 <= b <= 100.0 for _, b in self.logit_bias),
               "logit_bias values must be in [-100, 100]")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(all(w for w in self.bad_words), "bad_words entries must be non-empty")
        _check(self.logprobs is None or _is_int(self.logprobs) and 0 <= self.logprobs <= 20,
               f"logprobs must be in [0, 20], got {self.logprobs}")
        _check(self.prompt_logprobs is None or _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20,
               f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        _check(_is_int(self.n) and 1 <= self.n <= 128, f"n must be an integer in [1, 128], got {self.n}")
        _check(self.reasoning_tags is None or isinstance(self.reasoning_tags, ReasoningTags),
               "reasoning_tags must be a ReasoningTags")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_processors(self) -> bool:
        """Does any logits processor change this request's logits?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words or self.allowed_token_ids)


@dataclass(frozen=True)
class ReasoningTags:
    """A reasoning format's start and end tags as token ids (`dspark.chat.reasoning`)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    always_thinks: bool = False  # the model reasons first even without writing the start tag (DeepSeek-R1)
    call_start: tuple[int, ...] = ()  # a tool call's marker: opened while thinking, it ends the thoughts too

    def __post_init__(self) -> None:
        _check(bool(self.start) and bool(self.end), "reasoning_tags: the start and end tags need token ids")


MIN_REPETITION_PENALTY = 0.01
MAX_TEMPERATURE = 1e4  # beyond it every distribution is uniform to float32 anyway
MAX_INT32 = 2**31 - 1


def _is_real(x) -> bool:
    """A finite int or float (not a bool, not NaN or ±inf)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class TokenLogprob(NamedTuple):
    """One token's log-probability (an emitted token's under the processed target distribution, a prompt
    token's under the raw one), and the top k."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # [k] (token id, logprob), most likely first
    rank: int = 1  # 1 + the number of tokens more likely than this one


def logits_to_probs(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    *,
    temperature: torch.Tensor,  # [num_rows] float
    top_k: torch.Tensor,  # [num_rows] int, <= 0 means off
    top_p: torch.Tensor,  # [num_rows] float, 1.0 means off
    min_p: torch.Tensor | None = None,  # [num_rows] float, 0.0 means off
) -> torch.Tensor:  # [num_rows, vocab_size] float32, rows sum to 1
    """Processed target/draft distribution: one-hot argmax for greedy rows, else softmax(logits / T)
    without the tokens under min_p times the top probability, restricted to the top-k and then to the
    smallest top-p nucleus (vLLM's order)."""
    logits = logits.float()
    greedy = temperature < GREEDY_EPS  # [num_rows]
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    if min_p is not None and bool((min_p > 0).any()):
        probs = torch.softmax(scaled, dim=-1)
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values  # [num_rows, 1]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, greedy_ids(logits).unsqueeze(1), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    top_k: torch.Tensor,  # [num_rows]
    top_p: torch.Tensor,  # [num_rows]
) -> torch.Tensor:
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[-1]
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, vocab_size]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab_size)).unsqueeze(1)
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
