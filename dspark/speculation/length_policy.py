"""Verify-length policies: how many of each request's drafts the target verifies this step.

A policy sees the drafts' calibrated conditional confidences c_{r,k} (acceptance of draft k given
drafts 1..k-1 were accepted), the step's composition and the step-cost table, and returns
`verify_len` per request — always a prefix of that request's proposal.

* `FixedLength(verify_len)` — the classic γ (capped by what was proposed).
* `ConfidenceThreshold(threshold)` — keep the prefix whose survival a_k = Π_{i≤k} c_i stays
  ≥ threshold (or, with `cumulative=False`, DeepSpec's rule: cut at the first position whose conditional
  c_k < threshold; spec "threshold_rule": "conditional").
* `PrefixScheduler` — DSpark Algorithm 1 (reference §6.1): candidates (r, j) ranked by survival
  a_{r,j}; admitted greedily while the expected throughput
      Θ = (num_reqs + Σ admitted a) / (draft_seconds(num_reqs) + step_seconds(nondraft + admitted))
  keeps rising (with no draft curve this is Θ = τ · SPS(B); a prompt chunk riding the step is
  charged to the prompt, not to Θ's output tokens: `throughput_curve`). The loop BREAKS at the
  first admission that does not raise Θ. The break is what keeps sampling lossless (reference §6.2): c_{k+1} is
  computed from the sampled draft x_k, so a_{r,k+1} depends on x_k. Since a_{r,k+1} ≤ a_{r,k}, and
  ties are broken by position, (r, k+1) is examined only after x_k's admission is final, so
  admitting x_k never depends on x_k. Without the break (`break_on_drop=False`, tests only) a later
  candidate can flip an earlier decision: the Appendix A counterexample, reproduced in
  tests/test_length_policy.py.
* `AsyncPrefixScheduler` — production variant (reference §6.3, §7.4): the *capacity* K (total drafts
  verified this step) is the global argmax of Θ over survivals observed two steps earlier (a causal
  barrier: they cannot depend on this step's drafts), then this step's candidates ranked by current
  survival fill the K slots; no break is needed. The capacity reads only confidences handed to
  `observe()` (a two-entry queue), never the current step's, which `choose()` uses only to rank.

Both cost-aware policies take the step's context from the engine: `num_prompt_tokens` (the prompt
chunks among the non-draft tokens, charged to the prompt), `num_drafted_reqs` (rows the model drafter
ran for; prompt-lookup rows cost no draft seconds) and `max_drafts` (the budget the prompts leave: a
cap on the admitted count, lossless for the same reason as the break — (r, k) ranks above (r, k+1)).
The step's throughput arithmetic the policies share (`throughput_curve`, `drafting_gain`,
`masked_survival`) is public here: the draft gate (`draft_gate.py`) and the admission rule
(`admission.py`) price drafting with the same Θ.

Policies that need confidences or a cost table fail closed: `build_length_policy(...,
confidence_available=False)` or `choose(confidence=None)` raises a ValueError naming what is
missing.

    pytest tests/test_length_policy.py -q
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch

from dspark.config import LENGTH_POLICY_NAMES
from dspark.speculation.cost_table import CostTable

__all__ = ["LengthPolicy", "FixedLength", "ConfidenceThreshold", "PrefixScheduler",
           "AsyncPrefixScheduler", "LENGTH_POLICIES", "build_length_policy", "masked_survival",
           "throughput_curve", "drafting_gain", "decode_tokens", "ema"]



class LengthPolicy(Protocol):
    needs_confidence: ClassVar[bool]
    needs_cost: ClassVar[bool]

    def choose(
        self,
        *,
        confidence: torch.Tensor | None,  # [num_reqs, >= num_draft_tokens] calibrated c_k
        num_draft_tokens: int,  # γ: drafts proposed per request (the width of the proposal)
        num_nondraft_tokens: int,  # tokens in the step that are not drafts (1 per decoding request
        #                            + prefill chunk tokens)
        cost: CostTable | None = None,  # required by "prefix" and "async"
        num_reqs: int | None = None,  # needed only when confidence is None
        num_proposed: Sequence[int] | None = None,  # [num_reqs] drafts actually proposed (<= γ)
        num_prompt_tokens: int = 0,  # of num_nondraft_tokens, the prompt-chunk tokens (charged to
        #                              the prompt, not to the step's output: `throughput_curve`)
        num_drafted_reqs: int | None = None,  # requests the drafter ran its forward for (its seconds
        #                                       count in Θ); None: all num_reqs. Prompt-lookup rows are free
        max_drafts: int | None = None,  # prefix / async: at most this many drafts in all (the budget the
        #                                 step's prompt chunks leave); None: no cap
    ) -> list[int]:  # [num_reqs] verify_len per request
        ...


@dataclass(frozen=True)
class FixedLength:
    verify_len: int

    needs_confidence: ClassVar[bool] = False
    needs_cost: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.verify_len < 0:
            raise ValueError(f"verify_len must be >= 0, got {self.verify_len}")

    def choose(self, *, confidence, num_draft_tokens, num_nondraft_tokens, cost=None,
               num_reqs=None, num_proposed=None, num_prompt_tokens=0, num_drafted_reqs=None,
               max_drafts=None) -> list[int]:
        limits = _proposal_limits(confidence, num_draft_tokens, num_reqs, num_proposed)
        return [min(self.verify_len, limit) for limit in limits]


@dataclass(frozen=True)
class ConfidenceThreshold:
    threshold: float
    cumulative: bool = True  # True: survival Π c_i >= threshold; False: each conditional c_k >= it

    needs_confidence: ClassVar[bool] = True
    needs_cost: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")

    def choose(self, *, confidence, num_draft_tokens, num_nondraft_tokens, cost=None,
               num_reqs=None, num_proposed=None, num_prompt_tokens=0, num_drafted_reqs=None,
               max_drafts=None) -> list[int]:
        conditional = _checked_confidence(confidence, num_draft_tokens, policy="threshold")
        scores = np.cumprod(conditional, axis=1) if self.cumulative else conditional
        keep = scores >= self.threshold  # [num_reqs, num_draft_tokens]
        lengths = np.cumprod(keep, axis=1).sum(axis=1).tolist()  # leading run of kept positions
        limits = _proposal_limits(confidence, num_draft_tokens, num_reqs, num_proposed)
        return [min(length, limit) for length, limit in zip(lengths, limits)]


@dataclass(frozen=True)
class PrefixScheduler:
    break_on_drop: bool = True  # False is NOT lossless (Appendix A): for tests and ablations only

    needs_confidence: ClassVar[bool] = True
    needs_cost: ClassVar[bool] = True

    def choose(self, *, confidence, num_draft_tokens, num_nondraft_tokens, cost=None,
               num_reqs=None, num_proposed=None, num_prompt_tokens=0, num_drafted_reqs=None,
               max_drafts=None) -> list[int]:
        survival = masked_survival(confidence, num_draft_tokens, num_proposed, policy="prefix")
        cost = _require_cost(cost, policy="prefix")
        num_reqs = survival.shape[0]
        ranked_survival, ranked_reqs = _rank_candidates(survival)
        throughput = throughput_curve(ranked_survival, cost=cost, num_reqs=num_reqs,
                                       num_nondraft_tokens=num_nondraft_tokens,
                                       num_prompt_tokens=num_prompt_tokens, num_drafted_reqs=num_drafted_reqs)
        if self.break_on_drop:
            improves = throughput[1:] > throughput[:-1]  # [num_candidates]
            num_admitted = int(np.cumprod(improves).sum())  # stop at the first non-improvement
        else:
            num_admitted = int(np.argmax(throughput))  # first global maximum
        return _lengths_from_ranking(ranked_reqs[:_capped(num_admitted, max_drafts)], num_reqs)


class AsyncPrefixScheduler:
    """Capacity from confidences observed two `observe()` calls ago; current survivals fill it."""

    needs_confidence: ClassVar[bool] = True
    needs_cost: ClassVar[bool] = True

    def __init__(self, *, cold_start_len: int | None = None) -> None:
        # Until two observations exist: FixedLength(cold_start_len) (None: every proposed draft).
        if cold_start_len is not None and cold_start_len < 0:
            raise ValueError(f"cold_start_len must be >= 0, got {cold_start_len}")
        self.cold_start_len = cold_start_len
        self._history: deque[np.ndarray] = deque(maxlen=2)  # survivals [num_candidates] each

    def observe(
        self,
        confidence: torch.Tensor,  # [num_reqs, num_draft_tokens] a finished step's confidences
        *,
        num_proposed: Sequence[int] | None = None,  # [num_reqs]
    ) -> None:
        """Record a step's confidences; they set the capacity of the step after next."""
        survival = masked_survival(confidence, confidence.shape[1], num_proposed, policy="async")
        self._history.append(survival[survival > 0])

    def reset(self) -> None:
        self._history.clear()

    def capacity(self, *, cost: CostTable, num_reqs: int, num_nondraft_tokens: int,
                 num_prompt_tokens: int = 0, num_drafted_reqs: int | None = None) -> int | None:
        """K = global argmax of Θ over the stale survivals (no break); None during cold start."""
        if len(self._history) < 2:
            return None
        stale_survival = np.sort(self._history[0])[::-1]
        throughput = throughput_curve(stale_survival, cost=cost, num_reqs=num_reqs,
                                       num_nondraft_tokens=num_nondraft_tokens,
                                       num_prompt_tokens=num_prompt_tokens, num_drafted_reqs=num_drafted_reqs)
        return int(np.argmax(throughput))

    def choose(self, *, confidence, num_draft_tokens, num_nondraft_tokens, cost=None,
               num_reqs=None, num_proposed=None, num_prompt_tokens=0, num_drafted_reqs=None,
               max_drafts=None) -> list[int]:
        survival = masked_survival(confidence, num_draft_tokens, num_proposed, policy="async")
        cost = _require_cost(cost, policy="async")
        num_reqs = survival.shape[0]
        capacity = self.capacity(cost=cost, num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens,
                                 num_prompt_tokens=num_prompt_tokens, num_drafted_reqs=num_drafted_reqs)
        if capacity is None:  # cold start: a fixed length per request
            per_request = num_draft_tokens if self.cold_start_len is None else self.cold_start_len
            return FixedLength(per_request).choose(
                confidence=confidence, num_draft_tokens=num_draft_tokens,
                num_nondraft_tokens=num_nondraft_tokens, cost=cost, num_proposed=num_proposed)
        _, ranked_reqs = _rank_candidates(survival)
        return _lengths_from_ranking(ranked_reqs[:_capped(capacity, max_drafts)], num_reqs)


# name -> class: the one table of length policies; `SpecConfig.length_policy` takes exactly these names
LENGTH_POLICIES: dict[str, type] = {"fixed": FixedLength, "threshold": ConfidenceThreshold,
                                    "prefix": PrefixScheduler, "async": AsyncPrefixScheduler}
if tuple(LENGTH_POLICIES) != LENGTH_POLICY_NAMES:  # config checks names before this layer loads: keep them one
    raise ImportError(f"LENGTH_POLICIES {tuple(LENGTH_POLICIES)} differ from dspark.config.LENGTH_POLICY_NAMES "
                      f"{LENGTH_POLICY_NAMES}")


def build_length_policy(
    name: str,
    *,
    confidence_available: bool = True,  # does the drafter emit confidences?
    cost_available: bool = True,  # is a cost table loaded?
    **kwargs,
) -> LengthPolicy:
    """Construct a policy by name; fails closed if it needs confidences or a cost table that the
    engine does not have."""
    if name not in LENGTH_POLICIES:
        raise ValueError(f"unknown length policy {name!r}; known: {sorted(LENGTH_POLICIES)}")
    cls = LENGTH_POLICIES[name]
    if cls.needs_confidence and not confidence_available:
        raise ValueError(f"length policy {name!r} needs draft confidences, but the drafter "
                         f"provides none (use 'fixed', or a drafter with a confidence head)")
    if cls.needs_cost and not cost_available:
        raise ValueError(f"length policy {name!r} needs a cost table (SPS curve), but none is "
                         f"loaded (run `dspark profile` first)")
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------------
# Helpers


def _checked_confidence(confidence: torch.Tensor | None, num_draft_tokens: int, *,
                        policy: str) -> np.ndarray:  # [num_reqs, num_draft_tokens] float64
    if confidence is None:
        raise ValueError(f"length policy {policy!r} needs draft confidences, got confidence=None")
    if confidence.dim() != 2 or confidence.shape[1] < num_draft_tokens:
        raise ValueError(f"confidence must be [num_reqs, >= {num_draft_tokens}], "
                         f"got {tuple(confidence.shape)}")
    if confidence.device.type == "cpu" and confidence.dtype == torch.float32:  # a view, then fp64 (exact)
        values = confidence.detach().numpy()[:, :num_draft_tokens].astype(np.float64)
    else:
        values = confidence[:, :num_draft_tokens].detach().to("cpu", torch.float64).numpy()
    if np.isnan(values).any():
        raise ValueError(f"length policy {policy!r} got NaN confidences")
    return np.clip(values, 0.0, 1.0)


def masked_survival(confidence: torch.Tensor | None, num_draft_tokens: int,
                     num_proposed: Sequence[int] | None, *,
                     policy: str) -> np.ndarray:  # [num_reqs, num_draft_tokens] float64
    """a_{r,j} = Π_{i≤j} c_{r,i}, zeroed past what request r actually proposed."""
    survival = np.cumprod(_checked_confidence(confidence, num_draft_tokens, policy=policy), axis=1)
    if num_proposed is not None:
        limits = np.asarray(num_proposed).reshape(-1, 1)  # [num_reqs, 1]
        if limits.shape[0] != survival.shape[0]:
            raise ValueError(f"num_proposed has {limits.shape[0]} entries, "
                             f"expected {survival.shape[0]}")
        survival[np.arange(num_draft_tokens).reshape(1, -1) >= limits] = 0.0
    return survival


def _proposal_limits(confidence: torch.Tensor | None, num_draft_tokens: int, num_reqs: int | None,
                     num_proposed: Sequence[int] | None) -> list[int]:
    if num_proposed is not None:
        return [min(int(n), num_draft_tokens) for n in num_proposed]
    if num_reqs is None:
        if confidence is None:
            raise ValueError("need num_reqs (or num_proposed, or confidence) to size the batch")
        num_reqs = confidence.shape[0]
    return [num_draft_tokens] * num_reqs


def _require_cost(cost: CostTable | None, *, policy: str) -> CostTable:
    if cost is None:
        raise ValueError(f"length policy {policy!r} needs a cost table (SPS curve), got cost=None")
    return cost


def _rank_candidates(
    survival: np.ndarray,  # [num_reqs, num_draft_tokens]
) -> tuple[np.ndarray, np.ndarray]:  # ([num_candidates] survival, [num_candidates] req index)
    """Candidates with survival > 0, sorted by survival descending; ties keep position order (j
    before j+1), so every admitted set of leading candidates is a per-request prefix."""
    num_reqs, num_draft_tokens = survival.shape
    by_position = survival.T.reshape(-1)  # [num_draft_tokens * num_reqs], position-major
    req_index = np.tile(np.arange(num_reqs), num_draft_tokens)  # matches by_position
    positive = by_position > 0
    values, reqs = by_position[positive], req_index[positive]
    order = np.argsort(-values, kind="stable")
    return values[order], reqs[order]


def throughput_curve(
    ranked_survival: np.ndarray,  # [num_candidates] sorted descending
    *,
    cost: CostTable,
    num_reqs: int,
    num_nondraft_tokens: int,
    num_prompt_tokens: int = 0,
    num_drafted_reqs: int | None = None,  # None: the drafter ran for all num_reqs
    extra_seconds: float = 0.0,  # added to every denominator (the proposal's own bookkeeping)
) -> np.ndarray:  # [num_candidates + 1] Θ after admitting the first n candidates, n = 0..
    """Θ(n) = (num_reqs + Σ_{i<n} a_i) / (T(decode) + T(nondraft + n) − T(nondraft) + draft seconds).

    T(B) = 1 / SPS(B); decode = nondraft − prompt tokens (one token per decoding request). Without a
    prompt chunk this is Algorithm 1's Θ. With one, the chunk's own time T(nondraft) − T(decode) is
    the prompt's and leaves the denominator, while the drafts still pay what they add at the step's
    real size. Θ counts output tokens only: keeping the chunk's time in would value a draft against a
    long step (e.g. 16 decoding requests + a 256-token chunk: ~1 s for 16 tokens), so a draft with
    survival 0.06 would seem to pay, when each verified draft costs its full compute and saves at
    best a share of a later step. The draft seconds are the drafter's for the requests it
    ran for (`num_drafted_reqs`): prompt-lookup rows cost nothing, and charging a model forward that did
    not run would dilute the verify cost (at 16 lookup rows: 36 ms beside a 60 ms step, so drafts of
    survival 0.5 would pass where 0.75 is the break-even)."""
    expected_tokens = num_reqs + np.concatenate([[0.0], np.cumsum(ranked_survival)])
    step_seconds = cost.step_seconds_range(num_nondraft_tokens, len(ranked_survival) + 1)  # [num_candidates + 1]
    if num_prompt_tokens > 0:
        decode = decode_tokens(num_nondraft_tokens, num_prompt_tokens)
        step_seconds = step_seconds - step_seconds[0] + cost.step_seconds(decode)
    drafted = num_reqs if num_drafted_reqs is None else num_drafted_reqs
    draft_seconds = cost.draft_seconds_for(drafted) if drafted > 0 else 0.0
    return expected_tokens / (step_seconds + draft_seconds + extra_seconds)


def drafting_gain(curve: np.ndarray, *, num_reqs: int, num_nondraft_tokens: int, num_prompt_tokens: int,
          cost: CostTable) -> float:
    """max Θ over admitting the top candidates of `num_reqs` copies of the survival `curve` [γ], with the draft
    seconds, ÷ Θ of plain decoding."""
    candidates = np.sort(np.tile(curve, num_reqs))[::-1].copy()
    with_drafts = throughput_curve(candidates, cost=cost, num_reqs=num_reqs, num_nondraft_tokens=num_nondraft_tokens,
                                    num_prompt_tokens=num_prompt_tokens)
    return float(with_drafts.max() / (num_reqs * cost.sps(decode_tokens(num_nondraft_tokens, num_prompt_tokens))))


def ema(old, value, decay: float):
    """Exponential moving average: `value` itself when there is no `old` yet."""
    return value if old is None else decay * old + (1.0 - decay) * value


def _capped(num_admitted: int, max_drafts: int | None) -> int:
    """The admitted count under a cap on drafts. Lossless like the break: candidate (r, k) is ranked
    above (r, k + 1) (a_{r,k+1} <= a_{r,k}, ties by position), so its rank, and whether it falls under
    the cap, never depends on the draft x_k its successors' survivals are computed from."""
    return num_admitted if max_drafts is None else min(num_admitted, max(0, max_drafts))


def decode_tokens(num_nondraft_tokens: int, num_prompt_tokens: int) -> int:
    """Non-draft tokens that are not prompt-chunk tokens (at least 1)."""
    if not 0 <= num_prompt_tokens <= num_nondraft_tokens:
        raise ValueError(f"num_prompt_tokens must be in [0, num_nondraft_tokens={num_nondraft_tokens}], "
                         f"got {num_prompt_tokens}")
    return max(1, num_nondraft_tokens - num_prompt_tokens)


def _lengths_from_ranking(admitted_reqs: np.ndarray, num_reqs: int) -> list[int]:
    return np.bincount(admitted_reqs, minlength=num_reqs).tolist()
