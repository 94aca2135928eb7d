"""DSpark's sequential heads: the Markov transition bias (vanilla, gated), the RNN head, and the
confidence head (reference §2).

Every sequential head has two equivalent paths:

* `block_logits(base_logits=, hidden=, prev_ids=)`: teacher-forced, all γ positions at once
  (training): predecessors are given (`[anchor, y_1 .. y_{γ-1}]`).
* `step(base_logits=, hidden=, prev_ids=, state=)`: one position for a batch of rows (inference),
  called left to right with the token actually sampled at the previous position.

`tests/test_dspark_drafter.py` checks that feeding `step` the same predecessors reproduces
`block_logits`. Each head's bias is W2 · u_k for a rank-r vector u_k (vanilla: W1[x_{k-1}]; gated: g ⊙ W1[x_{k-1}];
RNN: tanh(o_k)), so `step(..., candidates=)` can score only some draft-vocabulary rows (top-K drafting: the
candidates are the base logits' K best, the correction is the candidates' rows of W2 times u_k). Predecessor ids are *target* vocabulary ids (the anchor can be any token), so
`markov_w1` has one row per target token; `markov_w2` and the logits use the draft vocabulary (equal to
the target vocabulary unless the checkpoint has a reduced `draft_vocab_size`).

`build_heads(cfg)` reads the head registry `SEQUENTIAL_HEADS`; markov_rank 0 means no sequential head
(DFlash).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dspark.kernels import Linear  # nn.Linear; few-row fp32 inference through the CPU kernel


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding(num_embeddings, embedding_dim), left uninitialized where it is built on the meta device (the
    shapes of a checkpoint, a model its tensors are then assigned to). There torch's `normal_` initializes
    nothing, and having no native meta kernel its first call imports torch's Python meta registrations (sympy,
    mpmath, ~800 modules: ~70 MiB resident for the rest of a served process). Elsewhere it is initialized as
    nn.Embedding always is."""
    weight = torch.empty(num_embeddings, embedding_dim)  # on the default device (a `torch.device` context)
    return nn.Embedding(num_embeddings, embedding_dim, _weight=weight) if weight.is_meta else \
        nn.Embedding(num_embeddings, embedding_dim)


class MarkovHead(nn.Module):
    """Vanilla first-order Markov bias: logits_k = base_k + W2 · W1[x_{k-1}]."""

    rows_dtype: torch.dtype | None = None  # the dtype W1's rows are read as, where `hold_rows_bf16` narrowed it

    def __init__(self, *, vocab_size: int, draft_vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.rank = rank
        self.markov_w1 = embedding(vocab_size, rank)  # rows: target ids
        self.markov_w2 = Linear(rank, draft_vocab_size, bias=False)  # weight [draft_vocab, rank]

    def embed_prev(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [...] target ids → [..., rank] (also the confidence head's input)."""
        rows = self.markov_w1(prev_ids)
        return rows if self.rows_dtype is None else rows.to(self.rows_dtype)

    def hold_rows_bf16(self) -> int:
        """Inference only: hold W1 (one row per target token: 12 MiB in fp32 for a 49152-token vocabulary) as
        bf16 where every value is a bf16 value (a checkpoint stored in bf16), its rows read back in the former
        dtype: the same values bit for bit. Returns the bytes freed (0 where a value would round)."""
        w = self.markov_w1.weight
        if w.dtype != torch.float32 or w.is_meta or not torch.equal(w.to(torch.bfloat16).float(), w):
            return 0
        self.rows_dtype = w.dtype
        self.markov_w1.weight = nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)
        return w.numel() * 2

    def _rank_input(self, prev_embed: torch.Tensor, hidden: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """u_k [..., rank] (the bias is W2 · u_k) and the next state."""
        return prev_embed, state

    def _bias(self, prev_embed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self._rank_input(prev_embed, hidden, None)[0])  # [..., draft_vocab]

    def project(self, u: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor:
        """W2 · u: u [num_rows, rank] → [num_rows, draft_vocab]; with candidates [num_rows, K] draft ids
        only those rows of W2: → [num_rows, K]."""
        if candidates is None:
            return self.markov_w2(u)
        rows = torch.nn.functional.embedding(candidates, self.markov_w2.weight)  # [num_rows, K, rank]
        return (rows @ u.to(rows.dtype).unsqueeze(-1)).squeeze(-1)  # [num_rows, K]

    def block_logits(
        self,
        *,
        base_logits: torch.Tensor,  # [..., num_slots, draft_vocab]
        hidden: torch.Tensor,  # [..., num_slots, hidden_size] final-normed backbone output
        prev_ids: torch.Tensor,  # [..., num_slots] long, target ids of the predecessors
    ) -> torch.Tensor:  # [..., num_slots, draft_vocab]
        bias = self._bias(self.embed_prev(prev_ids), hidden)
        return base_logits + bias.to(base_logits.dtype)

    def init_state(self, *, num_rows: int, device, dtype) -> Any:
        return None  # first-order Markov: no carried state

    def step(
        self,
        *,
        base_logits: torch.Tensor,  # [num_rows, draft_vocab]
        hidden: torch.Tensor,  # [num_rows, hidden_size]
        prev_ids: torch.Tensor,  # [num_rows] long target ids
        state: Any,
        candidates: torch.Tensor | None = None,  # [num_rows, K] draft ids: score only these
    ) -> tuple[torch.Tensor, Any]:  # ([num_rows, draft_vocab] or [num_rows, K] with candidates, next state)
        """base_logits are the full row, or with `candidates` the base logits of those candidates [num_rows, K]."""
        u, state = self._rank_input(self.embed_prev(prev_ids), hidden, state)
        return base_logits + self.project(u, candidates).to(base_logits.dtype), state


class GatedMarkovHead(MarkovHead):
    """Gated variant: g = σ(W_g [h_k ; e_k] + b_g) ∈ R^r, bias = W2 (g ⊙ e_k)."""

    def __init__(self, *, vocab_size: int, draft_vocab_size: int, hidden_size: int, rank: int):
        super().__init__(vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
                         hidden_size=hidden_size, rank=rank)
        self.gate_proj = Linear(hidden_size + rank, rank, bias=True)  # weight [rank, hidden + rank]

    def _rank_input(self, prev_embed, hidden, state):
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(prev_embed.dtype), prev_embed], -1)))
        return gate * prev_embed, state  # [..., rank]


class RNNHead(MarkovHead):
    """Recurrent head: z_k = [s_{k-1} ; W1[x_{k-1}] ; h_k]; (g, c, o) = joint_proj(z_k);
    s_k = σ(g)·s_{k-1} + (1-σ(g))·tanh(c); bias_k = W2 · tanh(o); s_0 = 0."""

    def __init__(self, *, vocab_size: int, draft_vocab_size: int, hidden_size: int, rank: int):
        super().__init__(vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
                         hidden_size=hidden_size, rank=rank)
        self.joint_proj = Linear(2 * rank + hidden_size, 3 * rank, bias=True)

    def _rank_input(self, prev_embed, hidden, state):
        """One cell step: (tanh(o_k) [..., rank], s_k [..., rank])."""
        z = torch.cat([state, prev_embed, hidden.to(prev_embed.dtype)], dim=-1)  # [..., 2r + d]
        gate, cand, out = self.joint_proj(z).chunk(3, dim=-1)  # each [..., rank]
        gate = torch.sigmoid(gate)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return torch.tanh(out), new_state

    def _cell(self, state: torch.Tensor, prev_embed: torch.Tensor, hidden: torch.Tensor):
        u, new_state = self._rank_input(prev_embed, hidden, state)
        return new_state, self.markov_w2(u)  # [..., rank], [..., draft_vocab]

    def block_logits(self, *, base_logits, hidden, prev_ids):
        prev_embed = self.embed_prev(prev_ids)  # [..., num_slots, rank]
        state = prev_embed.new_zeros(*prev_embed.shape[:-2], self.rank)  # [..., rank]
        biases = []
        for k in range(prev_ids.shape[-1]):  # teacher-forced unroll over the block
            state, bias = self._cell(state, prev_embed[..., k, :], hidden[..., k, :])
            biases.append(bias)
        return base_logits + torch.stack(biases, dim=-2).to(base_logits.dtype)

    def init_state(self, *, num_rows: int, device, dtype) -> torch.Tensor:
        return torch.zeros(num_rows, self.rank, device=device, dtype=dtype)  # [num_rows, rank]



class ConfidenceHead(nn.Module):
    """c_k = σ(w · [h_k ; W1[x_{k-1}]] + b); returns the raw logit in fp32 (consumers apply σ)."""

    def __init__(self, *, hidden_size: int, markov_rank: int):
        super().__init__()
        self.proj = Linear(hidden_size + markov_rank, 1, bias=True)  # weight [1, hidden + rank]
        self.with_markov = markov_rank > 0

    def forward(
        self,
        *,
        hidden: torch.Tensor,  # [..., hidden_size]
        prev_embed: torch.Tensor | None,  # [..., markov_rank] = W1[x_{k-1}], or None without Markov
    ) -> torch.Tensor:  # [...] float32 logits
        x = hidden if not self.with_markov else torch.cat([hidden, prev_embed.to(hidden.dtype)], -1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1).float()


SEQUENTIAL_HEADS: dict[str, type[MarkovHead]] = {
    "vanilla": MarkovHead,
    "gated": GatedMarkovHead,
    "rnn": RNNHead,
}


def build_heads(cfg) -> tuple[MarkovHead | None, ConfidenceHead | None]:
    """(sequential head or None, confidence head or None) for a `DSparkConfig`."""
    markov = None
    if cfg.markov_rank > 0:
        if cfg.markov_head_type not in SEQUENTIAL_HEADS:
            raise ValueError(f"markov_head_type {cfg.markov_head_type!r} unknown; "
                             f"registered: {', '.join(SEQUENTIAL_HEADS)}")
        markov = SEQUENTIAL_HEADS[cfg.markov_head_type](
            vocab_size=cfg.vocab_size, draft_vocab_size=cfg.effective_draft_vocab_size,
            hidden_size=cfg.hidden_size, rank=cfg.markov_rank)
    confidence = None
    if cfg.enable_confidence_head:
        rank = cfg.markov_rank if cfg.confidence_head_with_markov else 0
        confidence = ConfidenceHead(hidden_size=cfg.hidden_size, markov_rank=rank)
    return markov, confidence
