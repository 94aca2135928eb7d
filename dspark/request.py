"""Request: one generation's token state as the scheduler sees it (the engine knows only token ids); `Drafts`,
one request's proposed drafts as a value; `ScheduledRequest` / `SchedulerOutput`, the scheduler's output (each
window with the drafts it verifies) that the runner and the verifier read; `check_request`."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from dspark.logits_processors import check_token_ids
from dspark.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    num_drafts: int = 0  # verification rounds that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [num_draft_tokens]

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verification round, the bonus/recovered token counted (τ)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass(frozen=True)
class Drafts:
    """One request's drafts for its next verification, as the speculation controller proposed them; the
    scheduler holds them until it schedules the request's verify window (`ScheduledRequest.drafts`)."""

    ids: tuple[int, ...] = ()  # the valid drafts, in order (a grammar's forbidden tail already cut)
    probs: torch.Tensor | None = None  # [num_draft_tokens, vocab_size] or None (point mass)
    confidence: tuple[float, ...] | None = None  # conditional c_k per drafted position
    from_model: bool = True  # False: prompt lookup proposed them (lookup_first.py)
    verify_len: int = 0  # how many of them the next step verifies at most (ℓ)


NO_DRAFTS = Drafts()  # plain decoding: nothing to verify


class PendingContext(NamedTuple):
    """Committed positions of one step whose drafter context waits (`SpecController._extend_context`)."""

    start_pos: int
    token_ids: list[int]
    next_token_id: int | None  # token at start_pos + len(token_ids), when known
    taps: torch.Tensor | None  # [len(token_ids), num_taps * hidden] target taps, None without taps


class RequestError(str):
    """A failure message whose cause is the request itself (constraints no token satisfies), not the model or
    the engine: the server answers it with a 400 rather than a 500."""

    status = 400


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose target K/V are in the pool (committed)
    num_cached_tokens: int = 0  # of the prompt, served by a prefix-cache hit at admission
    num_draft_computed: int = 0  # positions whose drafter context K/V are in the pool
    # the model drafter keeps a context for this request (decided at admission, `Scheduler.model_drafting`:
    # False where drafting could not pay at the load it joined): without it, prompt lookup is its only drafter
    model_drafting: bool = True
    # committed positions whose drafter context is deferred while the draft gate skips, contiguous from
    # num_draft_computed (`defer_context`, `take_pending_context`), and how many
    pending_context: list["PendingContext"] = field(default_factory=list)
    num_pending_positions: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None  # a hybrid target's recurrent state slot (held with the KV blocks)
    finish_reason: str | None = None
    num_preemptions: int = 0
    waiting_steps: int = 0  # steps spent held back by prompt coalescing
    queued_steps: int = 0  # steps spent waiting for admission, for any reason
    # who sent it (the server: one HTTP request, its batch of prompts and n choices); waiting requests of one
    # client take turns with every other client's (`Scheduler.add`); None: a client of its own
    client: str | None = None
    queue_turn: int = 0  # its turn in the waiting queue (`Scheduler.add`)
    spec: SpecStats = field(default_factory=SpecStats)
    generator: torch.Generator | None = None  # rejection sampling of probabilistic drafts
    sample_seed: int = 0  # keys the target's sampling noise per output position (verify/sampler.py)
    grammar: Any = None  # structured output: a `structured.GrammarMatcher` over the committed output
    # prompt logprobs (`SamplingParams.prompt_logprobs`): [None, then one per prompt token scored so far], in
    # prompt order; positions scored before a preemption are not scored again
    prompt_logprobs: list | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if self.params.seed is not None:
            self.sample_seed = self.params.seed
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, pos: int) -> int | None:
        """all_ids[pos] without building all_ids; None past the end."""
        n = len(self.prompt_ids)
        if pos < n:
            return self.prompt_ids[pos]
        return self.output_ids[pos - n] if pos - n < len(self.output_ids) else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V the target has not computed yet (prompt left, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is left to compute: the next step is a decode/verify window."""
        return self.num_uncomputed_tokens == 1

    @property
    def needs_draft_context(self) -> bool:
        """Does the model drafter keep K/V for this request's positions?"""
        return self.params.speculation and self.model_drafting

    @property
    def scores_prompt(self) -> bool:
        """Are prompt positions left whose logits score the next prompt token (`prompt_logprobs`)?"""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop every computed position; the tokens stay."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_draft_computed = 0
        self.take_pending_context()
        self.block_table = []
        self.status = RequestStatus.WAITING
        self.num_preemptions += 1

    def defer_context(self, part: PendingContext) -> None:
        self.pending_context.append(part)
        self.num_pending_positions += len(part.token_ids)

    def take_pending_context(self) -> list[PendingContext]:
        """The deferred parts, oldest first; none are left."""
        parts, self.pending_context, self.num_pending_positions = self.pending_context, [], 0
        return parts


MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS = 64, 4096, 1024


class InvalidRequest(ValueError):
    """What is wrong with a request, naming its field (`param`): the server answers a 400 with both."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_request(prompt_ids: list[int], params: SamplingParams, *, max_model_len: int, vocab_size: int,
                  max_logprobs: int, max_tokens_fit: bool = False) -> None:
    """The one check of a request before the engine takes it (the engine runs it on every request; the server
    also before queueing, with `max_tokens_fit`: prompt + max_tokens within the context, vLLM's 400). Raises
    `InvalidRequest` naming the field: an empty prompt, one with no room for a token, an id outside the
    vocabulary, more logprobs than the server allows, too many or too long stop strings, token ids in the
    parameters outside the vocabulary."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}", "stop")
    long = [s for s in params.stop if len(s) > MAX_STOP_STRING_CHARS]
    if long:
        raise InvalidRequest(f"stop strings are at most {MAX_STOP_STRING_CHARS} characters, got {len(long[0])}",
                             "stop")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(params.stop_token_ids)}",
                             "stop_token_ids")
    n = len(prompt_ids)
    if not n:
        raise InvalidRequest("prompt is empty", "prompt")
    if n >= max_model_len:
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens; the prompt has {n} "
                             f"tokens, which leaves no room for the completion (the maximum model length is "
                             f"{max_model_len})", "prompt")
    if max_tokens_fit and params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, you "
                             f"requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} "
                             f"in the completion). Reduce the prompt or max_tokens.", "max_tokens")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name, None)
        if isinstance(k, int) and max_logprobs != -1 and k > max_logprobs:
            raise InvalidRequest(f"{name}={k} exceeds the server's max_logprobs ({max_logprobs}; --max-logprobs)",
                                 name)
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})", "prompt")
    try:
        check_token_ids(params, vocab_size)
    except ValueError as e:
        raise InvalidRequest(str(e), str(e).partition(":")[0]) from None


# -- the scheduler's output: what one step computes for each request (read by the runner and the verifier) --
@dataclass
class ScheduledRequest:
    """One request's window in a step: a prompt chunk, or the next token with the drafts it verifies."""

    request: Request
    num_new_tokens: int  # tokens of this request in the batch
    num_drafts: int  # drafts at the end of the window (ℓ); 0 for a prompt chunk or plain decode
    emits: bool  # the window reaches the last token: 1 + num_drafts logits rows
    start_pos: int = 0  # num_computed_tokens when scheduled: position of the first new token
    # hybrid targets with prefix caching: the state snapshot entry the step starts from (a prefix hit's first step;
    # -1: the request's state slot), and (position, entry) pairs whose states the step keeps (block boundaries)
    state_from: int = -1
    state_saves: tuple[tuple[int, int], ...] = ()
    drafts: Drafts = NO_DRAFTS  # what the request held when scheduled: the first num_drafts are verified

    @property
    def draft_ids(self) -> list[int]:
        """The drafts this window verifies [num_drafts]."""
        return list(self.drafts.ids[:self.num_drafts])

    @property
    def draft_probs(self) -> torch.Tensor | None:
        """Their distributions [num_drafts, vocab_size]; None where the drafts are point masses or absent."""
        probs = self.drafts.probs
        return None if probs is None or not self.num_drafts else probs[:self.num_drafts]

    @property
    def num_logits(self) -> int:
        return 1 + self.num_drafts if self.emits else 0

    @property
    def prompt_positions(self) -> range:
        """Positions of this window whose logits score the next prompt token (a request asking for prompt
        logprobs): prompt positions before the last that no earlier step scored."""
        req = self.request
        if not req.scores_prompt:
            return range(0)
        end = min(self.start_pos + self.num_new_tokens, len(req.prompt_ids) - 1)
        return range(max(self.start_pos, len(req.prompt_logprobs) - 1), end)


@dataclass
class SchedulerOutput:
    """One step's plan: each scheduled request's window with the drafts it verifies, and who was preempted."""

    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
