"""Logits processors: per-request changes to the target's logits before sampling, in one registry.

Each processor reads a request's `SamplingParams` and the tokens before the position it processes.
A verify window `[last, d1 .. dℓ]` has ℓ + 1 emitting rows; row j predicts output position
`len(output) + j`, so it sees the committed output followed by the drafts d1 .. dj that must have
been accepted for row j to matter. Plain decoding is the window with no drafts, so a speculative
step applies exactly what plain decoding applies at the same position, and the processed rows are
what both the greedy lane and rejection sampling read: speculation stays lossless.

Order (every processor in place on float32 rows):
  repetition_penalty (prompt and output tokens), frequency_penalty and presence_penalty (output
  tokens), logit_bias, then the masks: min_tokens (EOS and stop_token_ids), bad_words,
  allowed_token_ids. Temperature, min_p, top-k and top-p follow in `sampling.logits_to_probs`.

    pytest tests/test_logits_processors.py -q
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from dspark.sampling import SamplingParams

NEG_INF = float("-inf")


@dataclass
class WindowRows:
    """One request's emitting rows in a step, as the processors see them."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # committed output
    drafts: list[int]  # the window's drafts: row j sees output_ids + drafts[:j]
    eos_token_ids: tuple[int, ...] = ()
    _counts: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return len(self.drafts) + 1

    def history(self, j: int) -> list[int]:
        """The output row j follows."""
        return self.output_ids + self.drafts[:j]

    def counts(self, vocab_size: int, device) -> torch.Tensor:  # [num_rows, vocab_size] float32
        """How often each token occurs in the output row j follows."""
        if self._counts is None:
            base = torch.zeros(vocab_size, dtype=torch.float32)
            if self.output_ids:
                base.index_add_(0, torch.tensor(self.output_ids), torch.ones(len(self.output_ids)))
            counts = base.repeat(self.num_rows, 1)  # [num_rows, vocab_size]
            for j, d in enumerate(self.drafts):
                counts[j + 1:, d] += 1.0
            self._counts = counts.to(device)
        return self._counts


def _repetition(rows: torch.Tensor, w: WindowRows) -> None:
    penalty = w.params.repetition_penalty
    seen = w.counts(rows.shape[1], rows.device) > 0  # [num_rows, vocab_size]
    if w.prompt_ids:
        seen[:, torch.tensor(w.prompt_ids, device=rows.device)] = True
    scaled = torch.where(rows > 0, rows / penalty, rows * penalty)
    rows.copy_(torch.where(seen, scaled, rows))


def _frequency_presence(rows: torch.Tensor, w: WindowRows) -> None:
    counts = w.counts(rows.shape[1], rows.device)
    p = w.params
    rows.sub_(p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float())


def _logit_bias(rows: torch.Tensor, w: WindowRows) -> None:
    ids = torch.tensor([t for t, _ in w.params.logit_bias], device=rows.device)
    bias = torch.tensor([b for _, b in w.params.logit_bias], device=rows.device)
    rows[:, ids] += bias


def _min_tokens(rows: torch.Tensor, w: WindowRows) -> None:
    p = w.params
    stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(w.eos_token_ids))
    if not stops:
        return
    short = [j for j in range(w.num_rows) if len(w.output_ids) + j < p.min_tokens]
    if short:
        rows[torch.tensor(short).unsqueeze(1), torch.tensor(stops).unsqueeze(0)] = NEG_INF


def _bad_words(rows: torch.Tensor, w: WindowRows) -> None:
    for word in w.params.bad_words:
        *head, last = word
        for j in range(w.num_rows):
            hist = w.history(j)
            if not head or (len(hist) >= len(head) and hist[len(hist) - len(head):] == head):
                rows[j, last] = NEG_INF


def _allowed(rows: torch.Tensor, w: WindowRows) -> None:
    keep = torch.zeros(rows.shape[1], dtype=torch.bool, device=rows.device)
    keep[torch.tensor(w.params.allowed_token_ids, device=rows.device)] = True
    rows.masked_fill_(~keep, NEG_INF)


@dataclass(frozen=True)
class LogitsProcessor:
    name: str
    active: Callable[[SamplingParams], bool]
    apply: Callable[[torch.Tensor, WindowRows], None]  # ([num_rows, vocab_size] in place, window)


PROCESSORS: tuple[LogitsProcessor, ...] = (
    LogitsProcessor("repetition_penalty", lambda p: p.repetition_penalty != 1.0, _repetition),
    LogitsProcessor("frequency_presence", lambda p: bool(p.frequency_penalty or p.presence_penalty),
                    _frequency_presence),
    LogitsProcessor("logit_bias", lambda p: bool(p.logit_bias), _logit_bias),
    LogitsProcessor("min_tokens", lambda p: p.min_tokens > 0, _min_tokens),
    LogitsProcessor("bad_words", lambda p: bool(p.bad_words), _bad_words),
    LogitsProcessor("allowed_token_ids", lambda p: bool(p.allowed_token_ids), _allowed),
)


def apply_processors(rows: torch.Tensor, window: WindowRows) -> torch.Tensor:
    """[num_rows, vocab_size] → processed float32 copy (the input is not changed)."""
    out = rows.float().clone()
    for proc in PROCESSORS:
        if proc.active(window.params):
            proc.apply(out, window)
    return out


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the parameter whose token id is outside the vocabulary."""
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                      ("allowed_token_ids", params.allowed_token_ids),
                      ("stop_token_ids", params.stop_token_ids),
                      ("bad_words", [t for w in params.bad_words for t in w])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary (size {vocab_size})")
