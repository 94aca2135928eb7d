"""The drafter contract: what the engine hands a drafter and what it gets back.

A drafter never verifies and never owns request state. The engine tells it, once per step, which
positions became committed context (`ContextUpdate`: token ids, positions, pool slots and the target's
taps at exactly those positions) and then asks for drafts (`ProposeBatch` → `DraftProposal`). Drafters
with K/V (DSpark, DFlash, EAGLE-3, a draft model) declare extra layers in the target's paged pool
(`kv_layer_specs`) and index them with the request's own block table: context K/V at committed slots,
scratch K/V for the draft block at the slots just past the committed end, overwritten next step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from dspark.sampling import SamplingParams


@dataclass
class DraftProposal:
    draft_ids: torch.Tensor  # [num_reqs, num_draft_tokens] long
    # [num_reqs, num_draft_tokens, vocab_size] float32, or None (point masses); a list holds one
    # [num_draft_tokens, vocab_size] tensor or None per request (mixed sources: lookup_first.py)
    draft_probs: torch.Tensor | list[torch.Tensor | None] | None
    confidence: torch.Tensor | None  # [num_reqs, num_draft_tokens] conditional c_k in (0, 1), or None
    num_valid: list[int] | None = None  # [num_reqs] drafts actually proposed (n-gram may find fewer)
    # [num_reqs] rows the model drafter proposed, whose confidences come from its calibrated head (None:
    # every row); the draft gate and the online calibration learn from those rows only
    from_model: list[bool] | None = None


@dataclass
class ContextSegment:
    """One request's newly committed positions in this step's flat batch."""

    request_id: str
    block_table: list[int]
    start_pos: int  # first committed position of this segment
    token_ids: list[int]  # the input tokens at start_pos .. start_pos + len - 1
    next_token_id: int | None  # token at start_pos + len when known (EAGLE-3 pairs tap p with token p + 1)
    tap_rows: slice  # rows of ContextUpdate.taps for these positions


@dataclass
class ContextUpdate:
    segments: list[ContextSegment]
    taps: torch.Tensor | None  # [num_rows, num_taps * hidden_size] target residual-stream taps


@dataclass
class ProposeRequest:
    request_id: str
    all_ids: list[int]  # prompt + output so far; the last one is the anchor (not yet computed)
    anchor_pos: int  # = num_computed_tokens: position of the anchor
    block_table: list[int]  # covers anchor_pos + num_draft_tokens slots
    num_draft_computed: int  # positions whose drafter context K/V exist (≤ anchor_pos)
    params: SamplingParams
    generator: torch.Generator | None
    allow_model: bool = True  # False: the draft gate skipped this request; only free drafts (lookup)


@dataclass
class ProposeBatch:
    requests: list[ProposeRequest]
    kv_block_size: int
    draft_sample_method: str  # "greedy" | "probabilistic"


class Drafter(ABC):
    """Base class. Subclasses set `num_draft_tokens` and, if they read taps, `tap_layer_ids`."""

    num_draft_tokens: int
    tap_layer_ids: tuple[int, ...] = ()
    has_confidence: bool = False
    # proposes for requests with allow_model=False too (drafts that cost nothing: lookup_first.py)
    has_free_drafts: bool = False

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each extra KV layer this drafter keeps in the paged pool."""
        return []

    def bind_kv(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Receive the pool tensors for the layers declared in `kv_layer_specs`."""

    def bind_target_kv(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kv_layer_of: list[int] | None) -> None:
        """Receive the target's own pool (read in place, never written: Gemma 4's assistant attends to it);
        `kv_layer_of[i]` is target layer i's pool entry (None: entry i). Most drafters ignore it."""

    @property
    def needs_context_kv(self) -> bool:
        return bool(self.kv_layer_specs())

    def extend_context(self, update: ContextUpdate) -> dict[str, int]:
        """Write drafter context for newly committed positions. Returns request_id → new
        num_draft_computed (positions < it have drafter context)."""
        return {}

    @abstractmethod
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        ...

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed): drop whatever this drafter keeps for it."""

    def observe_finished(self, all_ids: list[int], num_prompt_tokens: int = 0) -> None:
        """A request finished with these committed tokens (prompt + output, the first
        `num_prompt_tokens` the prompt); drafters that learn from served traffic (the n-gram lookup's
        cross-request cache) take them, the others ignore them."""
