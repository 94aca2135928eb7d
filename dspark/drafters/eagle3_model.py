"""EAGLE-3 draft network: fused target taps → one decoder layer with a doubled-width input → the
drafter's own final norm → the target's LM head.

    fused_p = fc(concat(tap_1[p], .., tap_n[p]))                    [d]   (n target layers, fc: n·d → d)
    x_p     = concat(input_layernorm(embed(token_{p+1})), hidden_norm(h_p))   [2d]
    h'_p    = h_p + o_proj(attn(q/k/v_proj(x_p)))                    (q/k/v: 2d → heads · head_dim)
    h''_p   = h'_p + mlp(post_attention_layernorm(h'_p))             [d]
    logits  = lm_head(norm(h''_p))                                   predicts token_{p+2}

where h_p is fused_p for a committed position and, while drafting, the layer's own previous output
(feature recycling). We keep EAGLE-3's doubled-input attention rather than the simpler
`fc2(concat(embed, fused)) → d` + standard layer: it is the layout of the public EAGLE-3 checkpoints
(DeepSpec's `eagle3_*`: q/k/v projections of width 2d, `layers.0.hidden_norm`, `fc` [d, n·d]), so our
weight names and shapes line up with theirs, and the token embedding and the feature keep separate
normalisations instead of being mixed by an untrained projection before attention.

The embedding and the LM head are the target's, shared and frozen; they are bound with `bind_target`
and are not parameters of this module (not trained, not saved). With a reduced draft vocabulary
(`draft_vocab_size`, as EAGLE-3's and DFlash's public checkpoints do) the head is the target's LM-head
rows `d2t` (draft id → target id, a buffer saved with the weights): training scores [rows, draft_vocab]
logits (`draft_logits`), and `compute_logits` scatters them into the target vocabulary with −inf
outside it, so the sampling and verification code sees target ids only. The q/k/v and MLP modules are the
target family's (`models/llama.py`, `models/qwen3.py` when the target has q/k norm), so the paged
forward is the same code as the target's attention.

`training_forward` unrolls training-time test (TTT): step j ≥ 2 feeds the step j−1 output hidden in
place of the target feature, and its query attends causally to the step-1 keys plus, diagonally, to the
keys the same row produced at steps 2..j — exactly what the paged drafter sees when drafting (see
`eagle3.py`). Step j at row p sits at position p + j − 1, the position the draft occupies at inference.

Checkpoint (our format): `config.json` = `Eagle3Config.to_dict()`; `model.safetensors` with HF-style
unfused names (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ..., `norm.weight`), no embed/lm_head;
plus `d2t` [draft_vocab] int64 when the draft vocabulary is reduced, stored as offsets (target id = draft id +
d2t[draft id], `"d2t_format": "offset"`) and read in either convention (`vocab.py`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch
from torch import nn

from dspark.drafters.checkpoint import (CONFIG_NAME, check_tensors, config_file, load_tensors, read_config,
                                       save_weights, write_json)
from dspark.drafters.vocab import D2T_FORMAT_KEY, MAP_NAMES, WRITTEN_FORMAT, read_d2t, to_offsets
from dspark.models import llama, qwen3
from dspark.models.attention import AttnMetadata
from dspark.models.config import ModelConfig, dense_width
from dspark.models.files import CONFIG_ERRORS, SIZE_KEYS, check_sizes, config_error
from dspark.models.layers import Linear, MergedLinear, RMSNorm, RotaryEmbedding, drafter_rope_scaling
from dspark.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from dspark.models.qwen3 import Qwen3Attention

FORMAT = "dspark-eagle3"
KVCache = tuple[torch.Tensor, torch.Tensor]


def default_tap_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high taps: (1, L/2, L−4) as in EAGLE-3; shallow targets spread over what exists."""
    if num_layers >= 8:
        return (1, num_layers // 2, num_layers - 4)
    if num_layers >= 3:
        return (0, num_layers // 2, num_layers - 1)
    raise ValueError(f"target has {num_layers} layers: give tap_layer_ids explicitly")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # d, must equal the target's
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    tap_layer_ids: tuple[int, ...]  # target layers whose outputs are fused (-1 = embeddings)
    target_num_hidden_layers: int
    num_draft_tokens: int = 7  # TTT unroll length it was trained with
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    qk_norm: bool = False  # per-head q/k RMSNorm (Qwen3-style targets)
    attention_bias: bool = False
    draft_vocab_size: int | None = None  # None: score the whole target vocabulary
    norm_before_residual: bool = False  # the attention residual adds hidden_norm(h) instead of h (Speculators)
    format: str = FORMAT

    def __post_init__(self) -> None:
        object.__setattr__(self, "tap_layer_ids", tuple(int(i) for i in self.tap_layer_ids))
        if not self.tap_layer_ids or len(set(self.tap_layer_ids)) != len(self.tap_layer_ids):
            raise ValueError(f"tap_layer_ids must be non-empty and distinct, got {list(self.tap_layer_ids)}")
        bad = [i for i in self.tap_layer_ids if not -1 <= i < self.target_num_hidden_layers]
        if bad:
            raise ValueError(f"tap_layer_ids {bad} outside [-1, target_num_hidden_layers="
                             f"{self.target_num_hidden_layers})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if self.format != FORMAT:
            raise ValueError(f"config format {self.format!r} is not {FORMAT!r}")

    @property
    def num_taps(self) -> int:
        return len(self.tap_layer_ids)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size < self.vocab_size

    @classmethod
    def from_target(cls, target: ModelConfig, *, tap_layer_ids: tuple[int, ...] | None = None,
                    num_draft_tokens: int = 7, **overrides: Any) -> "Eagle3Config":
        """Drafter geometry copied from the target (heads, head_dim, MLP width, RoPE)."""
        taps = default_tap_layer_ids(target.num_hidden_layers) if tap_layer_ids is None else tap_layer_ids
        base = dict(hidden_size=target.hidden_size, intermediate_size=dense_width(target),
                    num_attention_heads=target.num_attention_heads,
                    num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                    vocab_size=target.vocab_size, tap_layer_ids=tuple(taps),
                    target_num_hidden_layers=target.num_hidden_layers, num_draft_tokens=num_draft_tokens,
                    rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                    rope_scaling=drafter_rope_scaling(target.rope_scaling), max_position_embeddings=target.max_position_embeddings,
                    qk_norm=target.qk_norm, attention_bias=target.attention_bias)
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tap_layer_ids"] = list(self.tap_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Eagle3Config":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown EAGLE-3 config key(s): {', '.join(unknown)}")
        return cls(**d)

    def layer_config(self) -> ModelConfig:
        """The decoder-layer geometry as a ModelConfig, to build the target family's modules."""
        return ModelConfig(
            architecture=(qwen3.FAMILY if self.qk_norm else llama.FAMILY).architecture,  # the layer's family
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias, qk_norm=self.qk_norm)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        lc = cfg.layer_config()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden_norm = RMSNorm(d, eps=eps, dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(d, eps=eps, dtype=dtype, device=device)
        self.self_attn = (Qwen3Attention if cfg.qk_norm else LlamaAttention)(lc, dtype=dtype, device=device)
        attn = self.self_attn
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        # EAGLE-3: q/k/v read [embedding ; feature], width 2d
        attn.qkv_proj = MergedLinear(2 * d, (("q", q_size), ("k", kv_size), ("v", kv_size)),
                                     bias=cfg.attention_bias, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, dtype=dtype, device=device)
        self.mlp = LlamaMLP(lc, dtype=dtype, device=device)
        self.norm_before_residual = cfg.norm_before_residual

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb, hidden [..., d] → [..., 2d]."""
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual over the incoming feature (normed with `norm_before_residual`), then the MLP block.
        [..., d] → [..., d]."""
        h = (self.hidden_norm(hidden) if self.norm_before_residual else hidden) + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(nn.Module):
    def __init__(self, cfg: Eagle3Config, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.fc = Linear(cfg.num_taps * d, d, bias=False, dtype=dtype, device=device)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, dtype=dtype, device=device)])
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(
            head_dim=cfg.head_dim, max_positions=cfg.max_position_embeddings + max(cfg.num_draft_tokens, 16),
            theta=cfg.rope_theta, scaling=cfg.rope_scaling, dtype=dtype, device=device)
        self._shared: tuple[Callable, Callable] | None = None  # (embed, lm_head): the target's, frozen
        # draft id → target id; persistent (saved, loaded) only for a reduced draft vocabulary
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size or cfg.vocab_size, device=device),
                             persistent=cfg.reduced_vocab)

    # -- shared target modules ------------------------------------------------------------------------
    def bind_target(self, *, embed: Callable[[torch.Tensor], torch.Tensor],
                    lm_head: Callable[[torch.Tensor], torch.Tensor]) -> "Eagle3Model":
        """embed: token ids [...] → [..., d]; lm_head: [rows, d] → logits [rows, draft_vocab] (the
        target's head, or its rows `d2t` for a reduced vocabulary). Kept outside the module's parameters
        (a plain tuple), so they are neither trained nor saved."""
        self._shared = (embed, lm_head)
        return self

    def _target(self) -> tuple[Callable, Callable]:
        if self._shared is None:
            raise RuntimeError("Eagle3Model has no embedding / LM head: call bind_target() first")
        return self._shared

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._target()[0](ids)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, d] (layer output, pre-norm) → logits [rows, draft_vocab] float32."""
        return self._target()[1](self.norm(hidden)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, d] → logits [rows, vocab] float32 over target ids (−inf outside the draft vocab)."""
        logits = self.draft_logits(hidden)  # [rows, draft_vocab]
        if not self.config.reduced_vocab:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.d2t] = logits
        return full

    def init_weights(self, *, std: float = 0.02, seed: int = 0) -> "Eagle3Model":
        """Random N(0, std) projections, unit norms (a fresh drafter before training)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    # -- paged inference ------------------------------------------------------------------------------
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., num_taps * d] → fused feature [..., d]."""
        return self.fc(taps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                attn_meta: AttnMetadata, kv_cache: KVCache) -> torch.Tensor:
        """Row i: token_{p+1} = input_ids[i] at position p = positions[i] with feature hidden[i] [d];
        stores its K/V per `attn_meta` and returns the layer output [num_rows, d] (pre-norm)."""
        layer = self.layers[0]
        cos, sin = self.rotary_emb.lookup(positions)
        x = layer.attn_input(self.embed(input_ids), hidden)  # [num_rows, 2d]
        return layer.finish(hidden, layer.self_attn(x, cos, sin, attn_meta, kv_cache))

    # -- training ------------------------------------------------------------------------------------
    def training_forward(self, *, taps: torch.Tensor, input_ids: torch.Tensor,
                         loss_mask: torch.Tensor | None = None, ttt_steps: int,
                         return_hidden: bool = False) -> list[torch.Tensor]:
        """Dense TTT unroll over right-padded sequences.

        taps [batch, seq_len, num_taps * d]: target taps at every position; input_ids [batch, seq_len].
        Returns `ttt_steps` logits [batch, seq_len, draft_vocab] float32; entry j (0-based) at row p predicts
        input_ids[p + j + 2] (`ttt_targets` gives the matching targets and mask). `loss_mask` is not
        needed by the forward (causality keeps padding out of earlier rows); it is accepted so every
        drafter's `training_forward` takes the same batch. `return_hidden`: the per-step layer outputs
        [batch, seq_len, d] instead, so a loss can score only its supervised rows (`draft_logits`)."""
        del loss_mask
        batch, seq_len = input_ids.shape
        layer = self.layers[0]
        attn = layer.self_attn
        hidden = self.fuse(taps)  # [batch, seq_len, d]
        keys: list[torch.Tensor] = []  # per step [batch, kv_heads, seq_len, head_dim]
        values: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        for j in range(ttt_steps):
            tokens = torch.zeros_like(input_ids)
            tokens[:, :max(seq_len - j - 1, 0)] = input_ids[:, j + 1:]  # row p holds token p + j + 1
            positions = (torch.arange(seq_len, device=input_ids.device) + j).clamp_(
                max=self.rotary_emb.max_positions - 1).repeat(batch)  # [batch * seq_len]
            cos, sin = self.rotary_emb.lookup(positions)
            x = layer.attn_input(self.embed(tokens), hidden).reshape(batch * seq_len, -1)
            qkv = attn.qkv_proj(x)
            q, k = attn.rope_qk(qkv, cos, sin)  # [B·S, H, hd], [B·S, Hkv, hd]
            v = qkv[:, attn.qk_size:].reshape(batch * seq_len, attn.num_kv_heads, attn.head_dim)
            q, k, v = (t.reshape(batch, seq_len, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
            keys.append(k)
            values.append(v)
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()  # [S, S]
            out = self._ttt_attention(q, keys, values, scale=attn.scale,
                                      visible=causal)  # [batch, heads, seq_len, hd]
            out = attn.o_proj(out.transpose(1, 2).reshape(batch * seq_len, -1)).view(batch, seq_len, -1)
            hidden = layer.finish(hidden, out)  # [batch, seq_len, d]
            logits.append(hidden if return_hidden else
                          self.draft_logits(hidden.reshape(batch * seq_len, -1)).view(batch, seq_len, -1))
        return logits

    def training_forward_chains(self, *, taps: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                                ttt_steps: int) -> list[torch.Tensor]:
        """The TTT unroll of `training_forward`, computed only for the chains that start at `anchors`.

        anchors [batch, num_chains] long: row positions p (ascending per sequence, -1 = no chain).
        Returns per step j [batch, num_chains, d]: the layer output of row p at step j — equal to
        `training_forward(..., return_hidden=True)[j][b, p]` — which predicts input_ids[p + j + 2].
        Only the step-1 keys/values are needed at every position (later steps attend to them causally
        and to their own chain's keys), so the full-width work is one q/k/v projection; attention,
        o_proj and the MLP run on batch·num_chains rows per step instead of batch·seq_len."""
        batch, seq_len = input_ids.shape
        layer = self.layers[0]
        attn = layer.self_attn
        heads, kv_heads, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        dev = input_ids.device
        live = anchors >= 0  # [batch, C]
        rows = anchors.clamp(min=0)  # [batch, C]
        bidx = torch.arange(batch, device=dev).unsqueeze(1).expand_as(rows)  # [batch, C]
        fused = self.fuse(taps)  # [batch, seq_len, d]
        # step 1 keys/values at every position: row p holds token p+1 at position p
        tokens = torch.zeros_like(input_ids)
        tokens[:, :seq_len - 1] = input_ids[:, 1:]
        positions = torch.arange(seq_len, device=dev).clamp(max=self.rotary_emb.max_positions - 1).repeat(batch)
        cos, sin = self.rotary_emb.lookup(positions)
        x = layer.attn_input(self.embed(tokens), fused).reshape(batch * seq_len, -1)
        qkv = attn.qkv_proj(x)
        q_all, k_all = attn.rope_qk(qkv, cos, sin)  # [B·S, H, hd], [B·S, Hkv, hd]
        v_all = qkv[:, attn.qk_size:].reshape(batch * seq_len, kv_heads, hd)
        k0 = k_all.reshape(batch, seq_len, kv_heads, hd).transpose(1, 2)  # [B, Hkv, S, hd]
        v0 = v_all.reshape(batch, seq_len, kv_heads, hd).transpose(1, 2)
        causal = torch.arange(seq_len, device=dev).view(1, 1, 1, seq_len) <= rows.view(batch, 1, -1, 1)  # [B,1,C,S]
        hidden = fused[bidx, rows]  # [B, C, d]
        keys: list[torch.Tensor] = [k0]  # step 1 at every position, then per step [B, Hkv, C, hd] (own chain)
        values: list[torch.Tensor] = [v0]
        out_steps: list[torch.Tensor] = []
        for j in range(ttt_steps):
            if j == 0:
                q = q_all.reshape(batch, seq_len, heads, hd)[bidx, rows]  # [B, C, H, hd]
            else:
                tok_pos = (rows + j + 1).clamp(max=seq_len - 1)
                tok = torch.where(rows + j + 1 < seq_len, input_ids[bidx, tok_pos], torch.zeros_like(rows))
                pos = (rows + j).clamp(max=self.rotary_emb.max_positions - 1).reshape(-1)
                cos, sin = self.rotary_emb.lookup(pos)
                xq = layer.attn_input(self.embed(tok), hidden).reshape(batch * rows.shape[1], -1)
                qkv_j = attn.qkv_proj(xq)
                q, k = attn.rope_qk(qkv_j, cos, sin)  # [B·C, H, hd], [B·C, Hkv, hd]
                v = qkv_j[:, attn.qk_size:].reshape(-1, kv_heads, hd)
                q = q.reshape(batch, -1, heads, hd)
                keys.append(k.reshape(batch, -1, kv_heads, hd).transpose(1, 2))
                values.append(v.reshape(batch, -1, kv_heads, hd).transpose(1, 2))
            o = self._ttt_attention(q.transpose(1, 2), keys, values, scale=attn.scale,
                                    visible=causal)  # [B, H, C, hd]
            o = attn.o_proj(o.transpose(1, 2).reshape(-1, heads * hd)).view(batch, -1, hidden.shape[-1])
            hidden = layer.finish(hidden, o)  # [B, C, d]
            out_steps.append(torch.where(live.unsqueeze(-1), hidden, torch.zeros_like(hidden)))
        return out_steps

    @staticmethod
    def _ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], *,
                       scale: float, visible: torch.Tensor) -> torch.Tensor:
        """q [B, H, Q, hd]; keys/values[0] [B, Hkv, S, hd] are the step-1 keys at every position, seen
        where `visible` ([Q, S] or [B, 1, Q, S] bool) allows; keys/values of steps 2..j [B, Hkv, Q, hd]
        are the query row's own (diagonal). → [B, H, Q, hd]."""
        rep = q.shape[1] // keys[0].shape[1]
        expand = (lambda t: t.repeat_interleave(rep, dim=1)) if rep > 1 else (lambda t: t)
        seq_len = keys[0].shape[2]
        scores = (q @ expand(keys[0]).transpose(-1, -2)) * scale  # [B, H, Q, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        diag = [(q * expand(k)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # each [B, H, Q, 1]
        probs = torch.cat([scores, *diag], dim=-1).float().softmax(dim=-1).to(q.dtype)
        out = probs[..., :seq_len] @ expand(values[0])
        for i, v in enumerate(values[1:]):
            out = out + probs[..., seq_len + i:seq_len + i + 1] * expand(v)
        return out


def ttt_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, step: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and mask for `training_forward(...)[step]`: row p predicts input_ids[p + step + 2],
    counted where that token exists and its loss_mask is set. Both [batch, seq_len]."""
    shift = step + 2
    targets = torch.zeros_like(input_ids)
    mask = torch.zeros_like(loss_mask, dtype=torch.bool)
    if shift < input_ids.shape[1]:
        targets[:, :-shift] = input_ids[:, shift:]
        mask[:, :-shift] = loss_mask[:, shift:].bool()
    return targets, mask


# -- checkpoint I/O ---------------------------------------------------------------------------------

_UNFUSED = {v: k for k, v in LlamaForCausalLM.packed_modules_mapping.items()}  # (fused, shard) → HF


def state_dict_hf(model: Eagle3Model) -> dict[str, torch.Tensor]:
    """Parameters under HF-style unfused names (q_proj / k_proj / v_proj, gate_proj / up_proj)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, MergedLinear):
            prefix, _, fused = module_name.rpartition(".")
            for shard, (start, rows) in module.shard_rows.items():
                out[f"{prefix}.{_UNFUSED[(fused, shard)]}.{leaf}"] = p.detach().narrow(0, start, rows)
        else:
            out[name] = p.detach()
    if model.config.reduced_vocab:
        out["d2t"] = model.d2t
    return {k: v.contiguous().clone() for k, v in out.items()}


def save_eagle3(model: Eagle3Model, cfg: Eagle3Config, path: str, *,
                dtype: torch.dtype | None = None, max_shard_bytes: int | None = None) -> None:
    """Write `path/config.json` and `path/model.safetensors` (shards of at most `max_shard_bytes` and an index
    when given; no shared embedding / LM head; a reduced vocabulary's `d2t` as offsets)."""
    os.makedirs(path, exist_ok=True)
    state = state_dict_hf(model)
    extra = {}
    if "d2t" in state:
        state["d2t"], extra[D2T_FORMAT_KEY] = to_offsets(state["d2t"]), WRITTEN_FORMAT
    write_json({**cfg.to_dict(), **extra}, os.path.join(path, CONFIG_NAME))
    save_weights(state, path, dtype=dtype, max_shard_bytes=max_shard_bytes)


def read_eagle3_config(path: str, *, num_target_layers: int | None = None) -> Eagle3Config:
    """Ours, DeepSpec's or vLLM Speculators' config.json (`formats.py`); `num_target_layers` (the target's
    depth) fills in what a Speculators config does not say."""
    from dspark.drafters.formats import eagle3_config_dict
    d, file = read_config(path), config_file(path)
    try:
        d = eagle3_config_dict(d, num_target_layers=num_target_layers, where=str(path))
        check_sizes(d, file=file, keys=(*SIZE_KEYS, "target_num_hidden_layers", "num_draft_tokens"))
        return Eagle3Config.from_dict(d)
    except CONFIG_ERRORS as e:
        raise config_error(file, e) from None


def load_eagle3(path: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                num_target_layers: int | None = None, draft_vocab: torch.Tensor | None = None) -> Eagle3Model:
    """Build from `path/config.json` and fill every parameter from its safetensors (a missing, unknown or
    mis-shaped tensor raises ValueError naming it; a bad `d2t` is refused before any weight is read). A stored
    embedding / LM head (DeepSpec, Speculators) is kept aside in `model.own_shared` (native dtype) for
    `eagle3.bind_to_target`. `draft_vocab` (target ids, ascending) gives a full-vocabulary checkpoint that
    reduced vocabulary (the head's rows at those ids). Call `bind_target` before use."""
    import dataclasses

    from dspark.drafters.formats import SHARED_KEYS, eagle3_tensors
    where = f"EAGLE-3 checkpoint {path!r}"
    cfg = read_eagle3_config(path, num_target_layers=num_target_layers)
    d2t = read_d2t(path, vocab_size=cfg.vocab_size, where=where)  # absolute target ids, or None
    if draft_vocab is not None:
        if cfg.reduced_vocab:
            raise ValueError(f"draft_vocab_size {draft_vocab.numel()}: {where} already has a {cfg.draft_vocab_size}"
                             "-token d2t; a reduced vocabulary is chosen at load for a full-vocabulary one only")
        d2t = draft_vocab.long().cpu()
        cfg = dataclasses.replace(cfg, draft_vocab_size=d2t.numel())
    model = Eagle3Model(cfg, dtype=dtype, device=device)
    tensors = eagle3_tensors(read_config(path), load_tensors(path, skip=MAP_NAMES, device=device), where=where)
    model.own_shared = {k: tensors.pop(k) for k in SHARED_KEYS if k in tensors}
    own_head = model.own_shared.get("lm_head.weight")
    if draft_vocab is not None and own_head is not None and own_head.shape[0] == cfg.vocab_size:
        model.own_shared["lm_head.weight"] = own_head[d2t.to(own_head.device)]  # the kept rows
    if d2t is not None:
        tensors["d2t"] = d2t
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    check_tensors({k: v.shape for k, v in state_dict_hf(model).items()}, tensors, where=where)
    params = dict(model.named_parameters())
    with torch.no_grad():
        if "d2t" in tensors:
            model.d2t = tensors.pop("d2t").to(device=device, dtype=torch.long)
        for hf_name, tensor in tensors.items():
            parts = hf_name.split(".")
            if len(parts) >= 2 and parts[-2] in LlamaForCausalLM.packed_modules_mapping:
                fused, shard = LlamaForCausalLM.packed_modules_mapping[parts[-2]]
                param = params[".".join(parts[:-2] + [fused, parts[-1]])]
                param.weight_loader(param, tensor, shard)
            else:
                params[hf_name].weight_loader(params[hf_name], tensor)
    return model
