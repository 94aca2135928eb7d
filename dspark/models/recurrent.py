"""Recurrent state of linear-attention layers (Gated DeltaNet, Qwen3-Next / Qwen3.5) beside the paged KV pool.

Each request that runs through a hybrid target holds one state slot (`Request.state_slot`, handed out and
taken back by the block manager with its KV blocks). A slot keeps a ring of `window` states per linear layer:
the state after position p sits at ring index p % window. A step that starts a request at position c reads
the state after c - 1 (zero at c = 0) and writes the states of the positions it computes, so after a
verification window of n <= window tokens the state after *every* position of the window is kept. When the
target accepts j drafts the request's next step starts at c + j + 1 and reads the state after c + j: the
rollback is the scheduler's counter moving back, no state is copied or recomputed. A prompt chunk longer
than the window keeps only its last state (nothing rolls back into a prompt).

Snapshots (prefix caching on a hybrid target): a pool of single states per linear layer beside the slots. A step
may ask a request's row to save the state after some of its positions into snapshot entries (`StateRows.saves`: a
long chunk's recurrence is cut there, so the state exists) and to start from a snapshot entry instead of its slot
(`StateRows.sources`: a prefix-cache hit). Which boundaries get an entry, and who owns it, is the block manager's.

The recurrence (the gated delta rule, per value head with a [dk, dv] state S):
    S <- exp(g_t) * S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
`delta_rule_tokens` runs it one token at a time and returns every intermediate state (the verification
path, for every request of a step with windows of the same length at once, and the slow twin of everything else); `delta_rule_chunked` runs a long prompt chunk in blocks of
`CHUNK` tokens with the WY form (a unit lower-triangular solve per block), returning the last state only. On the
CPU the windows run through one kernel call per layer and step instead (dspark.kernels.recurrent: the conv, the q/k
preparation and the one-token rule, each position's state written into the ring in place, `locate` naming the
source and `kept` recording what it wrote); `delta_rule_tokens` and `keep` are its slow twin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per block of the chunked recurrence


@dataclass(frozen=True)
class StateRows:
    """Where each request of a step reads and writes its recurrent state (host ints, one per request)."""

    slots: tuple[int, ...]  # state slot
    starts: tuple[int, ...]  # position of the first new token (the request's num_cached)
    lengths: tuple[int, ...]  # new tokens
    offsets: tuple[int, ...]  # row of the first new token in the flat batch
    sources: tuple[int, ...] = ()  # snapshot entry each request starts from (-1 or empty: its state slot)
    saves: tuple[tuple[tuple[int, int], ...], ...] = ()  # per request (position, snapshot entry): keep the state
    # after that position (one of its new tokens) in that entry

    def source(self, r: int) -> int:
        return self.sources[r] if self.sources else -1

    def saves_of(self, r: int) -> tuple[tuple[int, int], ...]:
        return self.saves[r] if self.saves else ()


@dataclass
class LayerState:
    """One linear-attention layer's state slots."""

    conv: torch.Tensor  # [num_slots, window, kernel - 1, conv_dim]: the last kernel - 1 conv inputs
    recurrent: torch.Tensor  # [num_slots, window, num_v_heads, head_k_dim, head_v_dim] fp32
    # [num_slots][window] the position whose state each ring entry holds (-1: none); checked on every read, so a
    # step that starts where no state was kept fails loudly instead of reading another position's state
    positions: list[list[int]] = field(default_factory=list)
    # snapshot entries: [num_snapshots, kernel - 1, conv_dim] and [num_snapshots, Hv, dk, dv] fp32, one state each
    snap_conv: torch.Tensor | None = None
    snap_recurrent: torch.Tensor | None = None
    snap_positions: list[int] = field(default_factory=list)  # the position whose state each entry holds (-1: none)

    def __post_init__(self) -> None:
        self.positions = [[-1] * self.window for _ in range(self.conv.shape[0])]
        self.snap_positions = [-1] * (0 if self.snap_conv is None else self.snap_conv.shape[0])

    @property
    def window(self) -> int:
        return self.conv.shape[1]

    def locate(self, slot: int, start: int, source: int = -1) -> tuple[int, int]:
        """Where the state after position start - 1 is: (ring entry of the slot, -1), (-1, snapshot entry `source`)
        or (-1, -1) for zeros (start 0). A place that does not hold that position's state is a RuntimeError."""
        if source >= 0:
            if self.snap_positions[source] != start - 1:
                raise RuntimeError(f"snapshot {source} holds the state after position {self.snap_positions[source]}, "
                                   f"not {start - 1}")
            return -1, source
        if start == 0:
            return -1, -1
        i = (start - 1) % self.window
        if self.positions[slot][i] != start - 1:
            raise RuntimeError(f"state slot {slot} keeps no state after position {start - 1} (it holds "
                               f"{sorted(p for p in self.positions[slot] if p >= 0)})")
        return i, -1

    def start(self, slot: int, start: int, source: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [kernel - 1, conv_dim], recurrent [Hv, dk, dv]) after position start - 1 (zeros at 0), copies; from
        snapshot entry `source` where it is >= 0 (which must hold that position's state)."""
        i, entry = self.locate(slot, start, source)
        if entry >= 0:
            return self.snap_conv[entry].clone(), self.snap_recurrent[entry].clone()
        if i < 0:
            return torch.zeros_like(self.conv[slot, 0]), torch.zeros_like(self.recurrent[slot, 0])
        return self.conv[slot, i].clone(), self.recurrent[slot, i].clone()

    def start_many(self, slots: list[int], starts: list[int], sources: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """`start` of several requests, stacked: (conv [B, kernel - 1, conv_dim], recurrent [B, Hv, dk, dv])."""
        parts = [self.start(slot, start, source) for slot, start, source in zip(slots, starts, sources)]
        return torch.stack([c for c, _ in parts]), torch.stack([r for _, r in parts])

    def claim(self, slot: int, pos: int) -> None:
        """Let a step start at pos + 1 without the state after pos computed: for timing runs (the step
        profiler), whose results nobody reads."""
        self.positions[slot][pos % self.window] = pos

    def keep(self, slot: int, first_pos: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store the states after positions first_pos .. first_pos + n - 1 (conv [n, kernel - 1, conv_dim],
        recurrent [n, Hv, dk, dv]; n <= window)."""
        n = conv.shape[0]
        idx = torch.arange(first_pos, first_pos + n, device=conv.device) % self.window  # [n]
        self.conv[slot].index_copy_(0, idx, conv.to(self.conv.dtype))
        self.recurrent[slot].index_copy_(0, idx, recurrent)
        self.kept(slot, first_pos, n)

    def kept(self, slot: int, first_pos: int, n: int) -> None:
        """Record that the ring holds the states after positions first_pos .. first_pos + n - 1 (written by `keep`,
        or in place by the window kernel, dspark.kernels.recurrent)."""
        for p in range(first_pos, first_pos + n):
            self.positions[slot][p % self.window] = p

    def save(self, entry: int, pos: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Keep the state after position pos (conv [kernel - 1, conv_dim], recurrent [Hv, dk, dv]) in snapshot
        entry `entry`."""
        self.snap_conv[entry].copy_(conv)
        self.snap_recurrent[entry].copy_(recurrent)
        self.snap_positions[entry] = pos


def allocate_layer_state(*, num_slots: int, window: int, kernel: int, conv_dim: int, num_v_heads: int,
                         head_k_dim: int, head_v_dim: int, dtype: torch.dtype, device,
                         num_snapshots: int = 0) -> LayerState:
    return LayerState(torch.zeros(num_slots, window, kernel - 1, conv_dim, dtype=dtype, device=device),
                      torch.zeros(num_slots, window, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32,
                                  device=device),
                      snap_conv=torch.zeros(num_snapshots, kernel - 1, conv_dim, dtype=dtype, device=device),
                      snap_recurrent=torch.zeros(num_snapshots, num_v_heads, head_k_dim, head_v_dim,
                                                 dtype=torch.float32, device=device))


def layer_state_bytes(*, window: int, kernel: int, conv_dim: int, num_v_heads: int, head_k_dim: int,
                      head_v_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one slot of one layer (window = 1: one snapshot entry)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return window * ((kernel - 1) * conv_dim * elem + num_v_heads * head_k_dim * head_v_dim * 4)


# -------------------------------------------------------------------------------------- causal conv


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over requests' new inputs (leading dims: requests, or none for one).

    x [..., n, C], state [..., K - 1, C] (the inputs before x), weight [C, K] -> (out [..., n, C], states
    [..., n, K - 1, C]: the last K - 1 inputs after each position)."""
    kernel = weight.shape[1]
    full = torch.cat([state.to(x.dtype), x], dim=-2)  # [..., K - 1 + n, C]
    windows = full.unfold(-2, kernel, 1)  # [..., n, C, K]
    out = F.silu((windows * weight).sum(-1))  # [..., n, C]
    states = full[..., 1:, :].unfold(-2, kernel - 1, 1).transpose(-1, -2)  # [..., n, K - 1, C]
    return out, states


# -------------------------------------------------------------------------------------- delta rule


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, dk] -> fp32 [..., Hv, dk]: L2-normalised (eps 1e-6 inside the root), each key head serving
    Hv / Hk consecutive value heads, q scaled by dk ** -0.5."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = num_v_heads // q.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def delta_rule_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time, for requests of n tokens each (leading dims: requests, or none for one). q, k
    [..., n, H, dk], v [..., n, H, dv], g, beta [..., n, H] (fp32, q and k from `prepare_qk`), state [..., H, dk, dv]
    -> (out [..., n, H, dv], states [..., n, H, dk, dv]: the state after each token)."""
    outs, states = [], []
    for t in range(q.shape[-3]):
        q_t, k_t, v_t = q[..., t, :, :], k[..., t, :, :], v[..., t, :, :]  # [..., H, d]
        state = state * g[..., t, :].exp()[..., None, None]
        predicted = (state * k_t.unsqueeze(-1)).sum(-2)  # [..., H, dv]: S^T k
        delta = (v_t - predicted) * beta[..., t, :].unsqueeze(-1)  # [..., H, dv]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)  # [..., H, dk, dv]
        outs.append((state * q_t.unsqueeze(-1)).sum(-2))  # [..., H, dv]: S^T q
        states.append(state)
    return torch.stack(outs, dim=-3), torch.stack(states, dim=-4)


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence in blocks of `chunk` tokens -> (out [n, H, dv], the last state [H, dk, dv]).

    Within a block with log-decays cumulated from its start (c_t), the writes u = beta (v - S_{t-1}^T k) of the
    block depend on each other through a unit lower-triangular system: with
    L_ts = beta_t exp(c_t - c_s) k_t.k_s (s < t), u = (I + L)^-1 (beta v - beta exp(c) k S_0). Then
    out_t = exp(c_t) q_t S_0 + sum_{s<=t} exp(c_t - c_s) (q_t.k_s) u_s and
    S_end = exp(c_end) S_0 + sum_s exp(c_end - c_s) k_s u_s^T."""
    n, heads, dk = k.shape
    pad = (-n) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    blocks = (n + pad) // chunk
    # [blocks, H, chunk, d]
    q, k, v = (x.view(blocks, chunk, heads, -1).transpose(1, 2) for x in (q, k, v))
    g, beta = (x.view(blocks, chunk, heads).transpose(1, 2) for x in (g, beta))  # [blocks, H, chunk]
    c = g.cumsum(-1)  # [blocks, H, chunk]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # [blocks, H, t, s]
    kb = k * beta.unsqueeze(-1)  # [blocks, H, chunk, dk]
    system = (kb @ k.transpose(-1, -2)) * decay  # diagonal read as 1 by the unitriangular solve
    u0 = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [blocks, H, t, s]
    q_decayed = q * c.exp().unsqueeze(-1)
    k_to_end = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    end_decay = c[..., -1].exp()[..., None, None]  # [blocks, H, 1, 1]
    out = torch.empty_like(v)
    for b in range(blocks):
        u = u0[b] - w[b] @ state  # [H, chunk, dv]
        out[b] = q_decayed[b] @ state + scores[b] @ u
        state = state * end_decay[b] + k_to_end[b].transpose(-1, -2) @ u
    return out.transpose(1, 2).reshape(-1, heads, v.shape[-1])[:n], state


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., d] -> rms_norm(x) * weight * silu(gate), normalised in fp32 (the HF order)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)
