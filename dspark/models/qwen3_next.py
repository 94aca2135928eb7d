"""Hybrid linear-attention targets: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text decoders), over the paged KV pool
for their full-attention layers and recurrent state slots for their Gated DeltaNet layers.

Layers follow `layer_types`: "linear_attention" layers are Gated DeltaNet (one input projection split into
q | k | v | z | b | a, a depthwise causal conv with SiLU over q | k | v, the gated delta rule of
`dspark.models.recurrent`, a gated RMSNorm, the output projection); "full_attention" layers are Qwen3 attention
with a sigmoid output gate (q_proj gives query and gate per head), per-head (1 + weight) RMSNorm on q and k and
RoPE over the first `partial_rotary_factor` of each head. Every RMSNorm outside the gated one multiplies by
(1 + weight). The MLP is dense, or the MoE block where `config.is_moe_layer(i)`.

Weights: Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` load into the fused `in_proj`; Qwen3-Next's
`in_proj_qkvz` / `in_proj_ba` (grouped per key head) are regrouped into the same layout at load. A multimodal
folder's `model.language_model.*` is the decoder; its vision tower and the `mtp.*` layers are skipped here
(`dspark.drafters.mtp` loads the latter).

Its config.json reader and writer (`hybrid_from_hf`, `hybrid_to_hf`) and the three family records (`FAMILIES`:
Qwen3-Next, Qwen3.5, Qwen3.5-MoE; one module class, the layout read from the config) close the file.

The model keeps no per-request state in its parameters: the state slots and the prefix cache's state snapshots
(`allocate_state`) are indexed by the step's `AttnMetadata.state` rows, and `num_kv_layers` counts the full-attention layers, whose paged K/V the
engine allocates as for any target.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable

import torch
from torch import nn

from dspark.kernels import recurrent as window_kernel
from dspark.models.attention import AttnMetadata, paged_attention, store_kv
from dspark.models.config import ModelConfig, eos_ids, hf_eos
from dspark.models.family import ModelFamily
from dspark.models.gemma3 import GemmaRMSNorm
from dspark.models.gguf_families import qwen_gguf
from dspark.models.layers import (Linear, MergedLinear, VocabEmbedding, apply_rope, default_weight_loader,
                                  rope_cos_sin, _set_loader)
from dspark.models.llama import KVCache, LlamaForCausalLM, LlamaMLP
from dspark.models.moe import MoeWeights, SparseMoeBlock
from dspark.models.qwen3_moe import moe_fields, moe_to_hf
from dspark.models.recurrent import (LayerState, StateRows, allocate_layer_state, causal_conv, delta_rule_chunked,
                                     delta_rule_tokens, gated_rms_norm, layer_state_bytes, prepare_qk)

log = logging.getLogger(__name__)

SKIPPED_WEIGHTS = re.compile(r"^(mtp\.|model\.visual\.|visual\.|model\.vision_tower\.)")


def _param(shape: tuple[int, ...], *, dtype: torch.dtype, device, fill: float = 0.0) -> nn.Parameter:
    return _set_loader(nn.Parameter(torch.full(shape, fill, dtype=dtype, device=device), requires_grad=False),
                       default_weight_loader)


class GatedAttention(nn.Module):
    """Full attention with an output gate and partial RoPE."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, (("q", 2 * q_size), ("k", kv_size), ("v", kv_size)),
                                     bias=cfg.attention_bias, dtype=dtype, device=device)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False, dtype=dtype, device=device)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.rotary_dim = int(self.head_dim * cfg.partial_rotary_factor)
        self.scale = self.head_dim ** -0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim  # [T, heads, hd]: the first r dims rotate, the rest pass
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], -1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv_cache: KVCache) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qg = qkv[:, :q_size].reshape(T, self.num_heads, 2 * self.head_dim)  # per head: query | gate
        q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:].reshape(T, -1)
        k = qkv[:, q_size:q_size + kv_size].reshape(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(T, self.num_kv_heads, self.head_dim).contiguous()
        q = self._rope(self.q_norm(q.contiguous()), cos, sin)  # [T, H, hd]
        k = self._rope(self.k_norm(k.contiguous()), cos, sin)  # [T, Hkv, hd]
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, all_stored=meta.all_stored)
        out = paged_attention(q, k_cache, v_cache, meta, scale=self.scale)  # [T, H, hd]
        return self.o_proj(out.reshape(T, -1) * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    """A linear-attention layer; its state lives in the slots of `LayerState`."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        hv = self.num_v_heads
        self.in_proj = MergedLinear(cfg.hidden_size, (("qkv", self.conv_dim), ("z", self.value_dim), ("b", hv),
                                                      ("a", hv)), bias=False, dtype=dtype, device=device)
        self.conv_weight = _param((self.conv_dim, self.kernel), dtype=dtype, device=device)  # HF [C, 1, K]
        self.conv_weight.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.dt_bias = _param((hv,), dtype=dtype, device=device, fill=1.0)
        self.A_log = _param((hv,), dtype=dtype, device=device)
        self.norm_weight = _param((self.head_v_dim,), dtype=dtype, device=device, fill=1.0)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False, dtype=dtype, device=device)
        self.eps = cfg.rms_norm_eps

    @staticmethod
    def _load_conv(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        default_weight_loader(param, loaded.reshape(param.shape))

    def state_shape(self) -> dict[str, int]:
        return {"kernel": self.kernel, "conv_dim": self.conv_dim, "num_v_heads": self.num_v_heads,
                "head_k_dim": self.head_k_dim, "head_v_dim": self.head_v_dim}

    def forward(self, x: torch.Tensor, rows: StateRows, state: LayerState) -> torch.Tensor:  # [T, hidden]
        T = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(self.in_proj.split_sizes, dim=-1)
        beta = b.float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * torch.nn.functional.softplus(a.float() + self.dt_bias.float())  # [T, Hv]
        core = x.new_empty(T, self.num_v_heads, self.head_v_dim)
        windows: dict[int, list[int]] = {}  # n -> the step's requests with n new tokens, n <= the ring
        for r, n in enumerate(rows.lengths):
            if n <= state.window:
                windows.setdefault(n, []).append(r)
            else:  # a long prompt chunk: the chunked recurrence, its last state only
                self._chunk(r, qkv, g, beta, rows, state, core)
        # every state of a window is kept (a rejection rolls back into it): all windows in one kernel call, or the
        # torch twin per window length
        if windows and not self._windows_kernel([r for m in windows.values() for r in m], qkv, g, beta, rows, state,
                                                core):
            for n, members in windows.items():
                self._windows(n, members, qkv, g, beta, rows, state, core)
        normed = gated_rms_norm(core, z.reshape(T, self.num_v_heads, -1), self.norm_weight, self.eps)
        return self.out_proj(normed.reshape(T, -1))

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [..., n, C] -> q, k [..., n, Hv, dk] (prepared), v [..., n, Hv, dv], fp32."""
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        lead = q.shape[:-1]
        q, k = prepare_qk(q.reshape(*lead, self.num_k_heads, -1), k.reshape(*lead, self.num_k_heads, -1),
                          self.num_v_heads)
        return q, k, v.reshape(*lead, self.num_v_heads, -1).float()

    def _windows(self, n: int, members: list[int], qkv, g, beta, rows: StateRows, state: LayerState, core) -> None:
        """Requests with n new tokens each, at once: the one-token recurrence, every position's state kept (the torch
        twin of `_windows_kernel`)."""
        slots, starts = [rows.slots[r] for r in members], [rows.starts[r] for r in members]
        idx = torch.tensor([rows.offsets[r] + t for r in members for t in range(n)], device=qkv.device)  # [B * n]
        conv0, rec0 = state.start_many(slots, starts, [rows.source(r) for r in members])  # [B, K-1, C], [B, Hv, dk, dv]
        mixed, conv_states = causal_conv(qkv[idx].view(len(members), n, -1), conv0, self.conv_weight)
        q, k, v = self._qkv(mixed)  # [B, n, Hv, d]
        out, states = delta_rule_tokens(q, k, v, g[idx].view(len(members), n, -1),
                                        beta[idx].view(len(members), n, -1), rec0)  # [B, n, Hv, dv], [B, n, ...]
        for j, (slot, start) in enumerate(zip(slots, starts)):
            state.keep(slot, start, conv_states[j], states[j])
            for pos, entry in rows.saves_of(members[j]):  # a snapshot at a block boundary (prefix caching)
                state.save(entry, pos, conv_states[j][pos - start], states[j][pos - start])
        core[idx] = out.reshape(len(members) * n, self.num_v_heads, -1).to(core.dtype)

    def _windows_kernel(self, members: list[int], qkv, g, beta, rows: StateRows, state: LayerState, core) -> bool:
        """The windows of `members` (any lengths up to the ring) in one kernel call (`window_kernel`:
        dspark.kernels.recurrent), their states written into the ring in place; False (nothing done) where the kernel
        does not apply."""
        table = []
        for r in members:  # where each starts (checked before anything is written)
            slot, start = rows.slots[r], rows.starts[r]
            table.append((slot, start, rows.lengths[r], rows.offsets[r], *state.locate(slot, start, rows.source(r))))
        if not self._kernel(table, qkv, g, beta, state, core):
            return False
        for r, (slot, *_) in zip(members, table):
            for pos, entry in rows.saves_of(r):  # a snapshot at a block boundary (prefix caching)
                i = pos % state.window
                state.save(entry, pos, state.conv[slot, i], state.recurrent[slot, i])
        return True

    def _kernel(self, table: list[tuple[int, ...]], qkv, g, beta, state: LayerState, core) -> bool:
        """`window_kernel.gated_delta_windows` over the rows of `table` (slot, start, length, first row, ring /
        snapshot source), the positions it wrote recorded in the ring; False where the kernel does not apply."""
        if not window_kernel.gated_delta_windows(qkv, g, beta, self.conv_weight, state.conv, state.recurrent,
                                                 state.snap_conv, state.snap_recurrent, table, self.num_k_heads, core):
            return False
        for slot, start, n, *_ in table:
            state.kept(slot, start, n)
        return True

    def _chunk(self, r: int, qkv, g, beta, rows: StateRows, state: LayerState, core) -> None:
        """A long prompt chunk: the chunked recurrence, cut after each position whose state a snapshot keeps. A piece
        no longer than the ring runs as a window (the kernel, or the one-token loop), as a step of that piece alone
        would (a prefix hit resuming at the cut computes what the cold run did)."""
        slot, start, n, off = rows.slots[r], rows.starts[r], rows.lengths[r], rows.offsets[r]
        source = state.locate(slot, start, rows.source(r))
        conv0, last = state.start(slot, start, rows.source(r))
        mixed, conv_states = causal_conv(qkv[off:off + n], conv0, self.conv_weight)  # [n, C], [n, K - 1, C]
        q, k, v = self._qkv(mixed)
        gc, bc = g[off:off + n], beta[off:off + n]
        kernel = window_kernel.windows_apply(qkv, self.conv_weight, state.conv, state.recurrent, core)
        saves = dict(rows.saves_of(r))  # position -> snapshot entry
        a = 0
        for b in sorted({pos + 1 - start for pos in saves} | {n}):  # pieces [a, b) of the chunk
            if b - a > state.window:
                out, last = delta_rule_chunked(q[a:b], k[a:b], v[a:b], gc[a:b], bc[a:b], last)
                core[off + a:off + b] = out.to(core.dtype)
            elif kernel:  # from the state after start + a - 1, kept in the ring for the kernel to read
                if a:
                    state.keep(slot, start + a - 1, conv_states[a - 1:a], last.unsqueeze(0))
                    source = ((start + a - 1) % state.window, -1)
                self._kernel([(slot, start + a, b - a, off + a, *source)], qkv, g, beta, state, core)
                last = state.recurrent[slot, (start + b - 1) % state.window].clone()
            else:
                out, states = delta_rule_tokens(q[a:b], k[a:b], v[a:b], gc[a:b], bc[a:b], last)
                last = states[-1]
                core[off + a:off + b] = out.to(core.dtype)
            if start + b - 1 in saves:
                state.save(saves[start + b - 1], start + b - 1, conv_states[b - 1], last)
            a = b
        state.keep(slot, start + n - 1, conv_states[-1:], last.unsqueeze(0))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.linear = cfg.layer_type(i) == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, device=device)
        else:
            self.self_attn = GatedAttention(cfg, dtype=dtype, device=device)
        moe = cfg.is_moe_layer(i)
        self.mlp = (SparseMoeBlock if moe else LlamaMLP)(cfg, dtype=dtype, device=device)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype,
                                                     device=device)

    def forward(self, x: torch.Tensor, cos, sin, meta: AttnMetadata, cache) -> torch.Tensor:  # [T, hidden]
        h = self.input_layernorm(x)
        if self.linear:
            if meta.state is None:
                raise ValueError("a hybrid target's step needs state rows (every request holds a state slot)")
            h = self.linear_attn(h, meta.state, cache)
        else:
            h = self.self_attn(h, cos, sin, meta, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i, dtype=dtype, device=device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        rotary = int(cfg.head_dim * cfg.partial_rotary_factor)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rotary, 2, dtype=torch.int64).float() / rotary))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)  # [rotary / 2] fp32


class Qwen3NextForCausalLM(MoeWeights, LlamaForCausalLM):
    """Qwen3-Next / Qwen3.5 / Qwen3.5-MoE text decoder (see the module docstring)."""

    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj", "qkv"), "in_proj_z": ("in_proj", "z"), "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }
    has_recurrent_state = True

    model_cls = HybridModel

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        super().__init__(cfg, dtype=dtype, device=device)
        self.attention_layers = [i for i, layer in enumerate(self.model.layers) if not layer.linear]
        self.linear_layers = [i for i, layer in enumerate(self.model.layers) if layer.linear]
        self.states: list[LayerState] = []

    @property
    def num_kv_layers(self) -> int:
        return len(self.attention_layers)

    def stack_rows(self) -> int:
        return 0  # the one-call CPU decoder stacks are attention-only

    # -- recurrent state ----------------------------------------------------------------------------
    def state_bytes_per_slot(self, window: int, dtype: torch.dtype) -> int:
        return sum(layer_state_bytes(window=window, dtype=dtype, **self.model.layers[i].linear_attn.state_shape())
                   for i in self.linear_layers)

    def allocate_state(self, *, num_slots: int, window: int, dtype: torch.dtype, device, num_snapshots: int = 0) -> None:
        """The state slots: `window` kept states per slot and linear layer (1 + the most drafts a window
        verifies); `num_snapshots` single states per linear layer for prefix caching (each as big as a slot of
        window 1)."""
        self.states = [allocate_layer_state(num_slots=num_slots, window=window, dtype=dtype, device=device,
                                            num_snapshots=num_snapshots,
                                            **self.model.layers[i].linear_attn.state_shape())
                       for i in self.linear_layers]

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: AttnMetadata,
                kv_caches: list[KVCache], tap_layer_ids: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions [T] -> (final-normed hidden [T, hidden], taps [T, n_taps * hidden] | None)."""
        m = self.model
        if len(kv_caches) != self.num_kv_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {self.num_kv_layers} full-attention layers")
        if len(self.states) != len(self.linear_layers):
            raise ValueError("the state slots are not allocated (allocate_state)")
        caches = [None] * len(m.layers)
        for i, kv in zip(self.attention_layers, kv_caches):
            caches[i] = kv
        for i, st in zip(self.linear_layers, self.states):
            caches[i] = st
        x = m.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = rope_cos_sin(positions, m.inv_freq, x.dtype)  # [T, 1, rotary] each
        taps, _, capture = self._tap_buffer(x, tap_layer_ids)
        for i, (layer, cache) in enumerate(zip(m.layers, caches)):
            x = layer(x, cos, sin, attn_meta, cache)
            capture(i, x)
        return m.norm(x), taps

    # -- weights ------------------------------------------------------------------------------------
    def _regroup(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Qwen3-Next's per-key-head grouped in_proj_qkvz / in_proj_ba -> Qwen3.5's in_proj_qkv, _z, _b, _a."""
        prefix, _, leaf = hf_name.rpartition(".in_proj_")
        layer = self.model.layers[int(re.search(r"layers\.(\d+)\.", hf_name).group(1))].linear_attn
        hk, dk, dv = layer.num_k_heads, layer.head_k_dim, layer.head_v_dim
        r = layer.num_v_heads // hk
        w = tensor.reshape(hk, -1, tensor.shape[-1])  # [Hk, group rows, hidden]
        if leaf.startswith("qkvz"):
            q, k, v, z = w.split((dk, dk, r * dv, r * dv), dim=1)
            flat = [t.reshape(-1, tensor.shape[-1]) for t in (q, k, v, z)]
            return [(f"{prefix}.in_proj_qkv.weight", torch.cat(flat[:3])), (f"{prefix}.in_proj_z.weight", flat[3])]
        b, a = w.split((r, r), dim=1)
        return [(f"{prefix}.in_proj_b.weight", b.reshape(-1, tensor.shape[-1])),
                (f"{prefix}.in_proj_a.weight", a.reshape(-1, tensor.shape[-1]))]

    def _hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        skipped = 0
        for name, tensor in weights:
            name = name.replace("model.language_model.", "model.", 1)
            if SKIPPED_WEIGHTS.search(name):
                skipped += 1
                continue
            if ".in_proj_qkvz." in name or ".in_proj_ba." in name:
                yield from self._regroup(name, tensor)
                continue
            name = (name.replace(".linear_attn.conv1d.weight", ".linear_attn.conv_weight")
                    .replace(".linear_attn.norm.weight", ".linear_attn.norm_weight"))
            yield name, tensor
        if skipped:
            log.info("%s: skipped %d checkpoint tensors (vision tower, MTP layers)", self.config.architecture, skipped)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> set[str]:
        return super().load_weights(self._hf_weights(weights), strict=strict)


# -- config.json: Qwen3NextConfig / Qwen3_5TextConfig / Qwen3_5MoeTextConfig -----------------------------------
def hybrid_from_hf(hf: dict[str, Any], arch: str, moe: Callable[[dict[str, Any]], dict[str, Any]]) -> ModelConfig:
    """Qwen3NextConfig / Qwen3_5TextConfig / Qwen3_5MoeTextConfig field names (a multimodal folder's
    `text_config`); `moe` reads the family's MoE fields."""
    if "text_config" in hf:
        hf = {**{k: v for k, v in hf.items() if k in ("tie_word_embeddings", "eos_token_id", "bos_token_id")},
              **hf["text_config"]}
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(layers)]
    params = hf.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {params.get('rope_type')!r} on {arch} is not supported")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf.get("intermediate_size") or 0, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids(hf.get("eos_token_id")),
        layer_types=tuple(layer_types), linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"], linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
        partial_rotary_factor=float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
        attn_output_gate=True, **moe(hf))


def hybrid_to_hf(c: ModelConfig, model_type: str) -> dict[str, Any]:
    """The text config.json of a hybrid target (tests build the transformers reference from it)."""
    out = {
        "architectures": [c.architecture], "model_type": model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias, "hidden_act": "silu", "bos_token_id": c.bos_token_id,
        "eos_token_id": hf_eos(c.eos_token_ids),
        "layer_types": list(c.layer_types[:c.num_hidden_layers]),
        "linear_num_key_heads": c.linear_num_key_heads, "linear_num_value_heads": c.linear_num_value_heads,
        "linear_key_head_dim": c.linear_key_head_dim, "linear_value_head_dim": c.linear_value_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.partial_rotary_factor},
    }
    return out


def _next_moe(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's MoE fields: Qwen3-MoE's plus the shared expert (a dense config says num_experts 0)."""
    if not hf.get("num_experts"):
        return {}
    return {**moe_fields(hf), "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0)}


def _next_moe_to_hf(c: ModelConfig) -> dict[str, Any]:  # its defaults are MoE: a dense one says num_experts 0
    out = dict(num_experts=c.num_experts, shared_expert_intermediate_size=c.shared_expert_intermediate_size)
    if c.num_experts:
        out.update({k: v for k, v in moe_to_hf(c).items() if k not in ("model_type", "use_sliding_window")})
    return out


def _q35_moe(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE routes every layer and always renormalises the top-k (its config has neither field)."""
    if not hf.get("num_experts"):
        return {}
    return dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True,
                shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0))


def _q35_moe_to_hf(c: ModelConfig) -> dict[str, Any]:
    return dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size,
                shared_expert_intermediate_size=c.shared_expert_intermediate_size)


def _hybrid(architecture: str, model_types: tuple[str, ...], gguf_name: str, moe, moe_to_hf_,
            hf_architectures: tuple[str, ...] = (), drop: tuple[str, ...] = (), tiled: bool = True) -> ModelFamily:
    """A hybrid family's record: one module class, the layout read from the config; `drop`: keys its config.json
    does not have; `tiled`: llama.cpp's converter reorders its value heads to tiled (Qwen3.5, not Qwen3-Next)."""
    def to_hf(c: ModelConfig) -> dict[str, Any]:
        out = {**hybrid_to_hf(c, model_types[0]), **moe_to_hf_(c)}
        return {k: v for k, v in out.items() if k not in drop}
    return ModelFamily(
        architecture=architecture, model_class=Qwen3NextForCausalLM, model_types=model_types,
        hf_architectures=hf_architectures, from_hf=lambda hf: hybrid_from_hf(hf, architecture, moe), to_hf=to_hf,
        qk_norm=True, recurrent_state=True, mtp="layers",
        no_tensor_parallel="its linear-attention layers and state slots are not split over ranks",
        gguf_names=(gguf_name,), gguf=qwen_gguf(architecture, reordered_value_heads=tiled), gguf_blocks=True)


FAMILIES = (
    _hybrid("Qwen3NextForCausalLM", ("qwen3_next",), "qwen3next", _next_moe, _next_moe_to_hf, tiled=False),
    _hybrid("Qwen3_5ForCausalLM", ("qwen3_5_text", "qwen3_5"), "qwen35", lambda hf: {}, lambda c: {},
            hf_architectures=("Qwen3_5ForConditionalGeneration",)),
    _hybrid("Qwen3_5MoeForCausalLM", ("qwen3_5_moe_text", "qwen3_5_moe"), "qwen35moe", _q35_moe, _q35_moe_to_hf,
            hf_architectures=("Qwen3_5MoeForConditionalGeneration",), drop=("intermediate_size",)),
)
