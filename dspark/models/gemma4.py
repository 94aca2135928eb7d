"""Gemma 4 target model (text decoder: `Gemma4ForCausalLM`, or the `model.language_model` of a multimodal
`Gemma4ForConditionalGeneration` folder) over the paged KV pool, with the same residual-stream taps as `llama.py`.

transformers' `Gemma4TextModel`, op for op:
* sliding and full attention layers (`layer_types`), each kind with its own head shape (a full layer's head is
  `global_head_dim` wide with `num_global_key_value_heads`) and its own RoPE: default RoPE at `rope_local_theta`
  on sliding layers, the full layers' `rope_scaling` (proportional RoPE: the first `partial_rotary_factor` of each
  half rotates, the rest keeps frequency 0) at `rope_theta`; a sliding query at p reads keys (p - window, p];
* attention scale 1.0 after per-head RMSNorm on q and k (with weights) and on v (without); a K = V full layer
  (`attention_k_eq_v`) has no v_proj: v is the raw k projection, normed by the weightless v norm, k its k-normed,
  rotated copy;
* KV sharing (`num_kv_shared_layers`): the last layers compute no K/V and read the pool of the last earlier
  layer of their kind. The pool holds only the layers that own K/V (`num_kv_layers`, `kv_layer_specs()` gives
  each its (heads, head_dim)); `cache_index[i]` is layer i's pool entry; a shared layer stores nothing;
* RMSNorm multiplies by the stored weight (not 1 + weight), normalised and scaled in fp32, cast back once;
* per-layer inputs (`hidden_size_per_layer_input` P): `embed_tokens_per_layer` rows (scaled by sqrt(P)) plus the
  RMS-normed `per_layer_model_projection` of the scaled embedding (times hidden ** -0.5), times 2 ** -0.5, give
  each layer a [P] input; after its feed-forward a layer adds post_norm(proj(gelu(gate(x)) * input));
* the MoE block (`num_experts`): beside the dense MLP, a router (weightless RMSNorm, times `router.scale` and
  hidden ** -0.5, fp32 softmax, top-k renormalised, times `per_expert_scale`) and GELU-tanh experts on the
  pre-feed-forward residual, each branch with its own norms, summed;
* each layer's output times its `layer_scalar`; the embedding times sqrt(hidden) in the weights' dtype, the
  head tied, the logits soft-capped when `final_logit_softcapping` is set.

Every step runs the per-layer modules (`stack_rows()` 0: the one-call CPU stacks know neither KV sharing nor
per-kind head sizes). A MoE step reads its rows per expert on the host (CUDA graph capture refused, as
`moe.Experts`); the dense model reads nothing on the host. Tensor parallelism refuses Gemma 4
(`distributed.shard.check_shardable`); a layer-truncated draft view of it is refused (`drafters.draft_model`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from dspark import kernels
from dspark.models.attention import AttnMetadata, paged_attention, sliding_window_metadata, store_kv
from dspark.models.config import ModelConfig
from dspark.models.family import ModelFamily
from dspark.models.gemma3 import Gemma3MLP, _rounded
from dspark.models.gemma4_hf import gemma4_fields, gemma4_to_hf
from dspark.models.gguf_families import GEMMA4_GGUF
from dspark.models.layers import (Fp32Buffers, Linear, MergedLinear, RMSNorm, VocabEmbedding, ROPE_INIT,
                                  _set_loader, apply_rope, default_weight_loader, rope_cos_sin, rope_type)
from dspark.models.llama import KVCache, LlamaForCausalLM
from dspark.models.moe import Experts, MoeWeights

log = logging.getLogger(__name__)

# the multimodal folder's towers and their projections into the text stream: not part of the text decoder
SKIPPED_WEIGHTS = re.compile(r"^(model\.)?(vision_tower|audio_tower|embed_vision|embed_audio|vision_model|"
                             r"audio_model|multi_modal_projector)\.")
_SHARED_LAYER_KV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def _inv_freq_proportional(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """transformers' proportional RoPE: [hd/2] fp32, the first int(factor * hd // 2) angles of the default
    spectrum over the whole head_dim, the rest 0 (those pairs are not rotated), all divided by `factor`."""
    angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))  # [angles]
    return torch.cat((inv, torch.zeros(head_dim // 2 - angles))) / float(scaling.get("factor", 1.0))


ROPE = {**ROPE_INIT, "proportional": _inv_freq_proportional}


def layer_shape(cfg: ModelConfig, kind: str) -> tuple[int, int]:
    """(KV heads, head_dim) of a layer of attention kind `kind`."""
    if kind == "full_attention":
        return cfg.num_global_key_value_heads or cfg.num_key_value_heads, cfg.global_head_dim or cfg.head_dim
    return cfg.num_key_value_heads, cfg.head_dim


def kv_layout(cfg: ModelConfig) -> tuple[list[int], list[int]]:
    """(owners, cache_index): the layers that compute and store K/V (in order: pool entry j is owners[j]), and
    each layer's pool entry; a KV-shared layer reads the entry of the last non-shared layer of its kind."""
    n = cfg.num_hidden_layers
    if cfg.num_hidden_layers < len(cfg.layer_types):
        raise ValueError("a layer-truncated view of Gemma 4 is not supported (its KV sharing and per-layer inputs "
                         "span every layer)")
    first_shared = n - cfg.num_kv_shared_layers
    if not 0 < first_shared <= n:
        raise ValueError(f"num_kv_shared_layers={cfg.num_kv_shared_layers} must leave some of the {n} layers "
                         "computing K/V")
    kinds = [cfg.layer_type(i) for i in range(n)]
    index = list(range(first_shared))
    for i in range(first_shared, n):
        owners = [j for j in range(first_shared) if kinds[j] == kinds[i]]
        if not owners:
            raise ValueError(f"KV-shared layer {i} ({kinds[i]}) has no earlier {kinds[i]} layer to read")
        index.append(owners[-1])
    return list(range(first_shared)), index


def _param(shape: tuple[int, ...], *, dtype: torch.dtype, device, fill: float = 1.0) -> nn.Parameter:
    return _set_loader(nn.Parameter(torch.full(shape, fill, dtype=dtype, device=device), requires_grad=False),
                       default_weight_loader)


def _plain_rms(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., d] -> [..., d], no weight, fp32 inside
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class Gemma4RMSNorm(RMSNorm):
    """y = x / rms(x) * weight (transformers' Gemma4RMSNorm: in fp32, one cast back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        if x.dtype == torch.float32:
            return kernels.rms_norm(x.contiguous(), self.weight, self.eps)
        return (F.rms_norm(x.float(), self.shape, None, self.eps) * self.weight.float()).to(x.dtype)


class Gemma4Rotary(Fp32Buffers):
    """cos/sin per layer kind, computed per step from the positions (each kind over its own head_dim)."""
    fp32_buffers = ("inv_freq_full", "inv_freq_sliding")

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str) -> None:
        super().__init__()
        kind = rope_type(cfg.rope_scaling)
        if kind not in ROPE:
            raise ValueError(f"unsupported Gemma 4 rope type {kind!r}; supported: {', '.join(ROPE)}")
        full_dim, local_dim = layer_shape(cfg, "full_attention")[1], cfg.head_dim
        self.register_buffer("inv_freq_full", ROPE[kind](full_dim, cfg.rope_theta, dict(cfg.rope_scaling or {})).to(
            device), persistent=False)  # [full hd / 2] fp32
        self.register_buffer("inv_freq_sliding", ROPE["default"](local_dim, cfg.rope_local_theta or cfg.rope_theta,
                                                                 {}).to(device), persistent=False)  # [hd / 2]

    def lookup(self, positions: torch.Tensor, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, 1, the kind's hd], rotate-half's sign folded into sin."""
        return rope_cos_sin(positions, self.inv_freq_sliding if kind == "sliding_attention" else self.inv_freq_full,
                            dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, shared: bool, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.layer_type = cfg.layer_type(layer_id)
        full = self.layer_type == "full_attention"
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads, self.head_dim = layer_shape(cfg, self.layer_type)
        self.shared, self.k_eq_v, self.eps = shared, cfg.attention_k_eq_v and full, cfg.rms_norm_eps
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shards = [("q", self.q_size)] + ([] if shared else [("k", self.kv_size)])
        shards += [] if shared or self.k_eq_v else [("v", self.kv_size)]
        self.qkv_proj = MergedLinear(cfg.hidden_size, tuple(shards), bias=cfg.attention_bias, dtype=dtype,
                                     device=device)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype, device=device)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        if not shared:
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.window = None if full else cfg.sliding_window

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv_cache: KVCache) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + Hkv (+ Hkv)) * hd], or [T, H * hd] on a shared layer
        q = self.q_norm(qkv[:, :self.q_size].contiguous().view(T, self.num_heads, self.head_dim))
        q = apply_rope(q, cos, sin)  # [T, H, hd]
        k_cache, v_cache = kv_cache
        if not self.shared:  # a shared layer reads what its owner stored earlier in this step
            end = self.q_size + self.kv_size
            k = qkv[:, self.q_size:end].contiguous().view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, hd]
            v = k if self.k_eq_v else qkv[:, end:].contiguous().view(T, self.num_kv_heads, self.head_dim)
            v = _plain_rms(v, self.eps)  # the weightless v norm, on the raw projection
            k = apply_rope(self.k_norm(k), cos, sin)  # [T, Hkv, hd]
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, all_stored=meta.all_stored)
        if self.window is not None:
            meta = sliding_window_metadata(meta, self.window)
        out = paged_attention(q, k_cache, v_cache, meta, scale=1.0)  # [T, H, hd]
        return self.o_proj(out.reshape(T, -1))


class Gemma4Router(nn.Module):
    """HF `router`: x [T, hidden] -> (weights [T, k] fp32, experts [T, k] long)."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.top_k, self.eps, self.root = cfg.num_experts_per_tok, cfg.rms_norm_eps, cfg.hidden_size ** -0.5
        self.proj = Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype, device=device)
        self.scale = _param((cfg.hidden_size,), dtype=dtype, device=device)  # [hidden]
        self.per_expert_scale = _param((cfg.num_experts,), dtype=dtype, device=device)  # [E]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = _plain_rms(x, self.eps) * self.scale * self.root  # [T, hidden]
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)  # [T, E] fp32
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w * self.per_expert_scale[top_i], top_i


class Gemma4Experts(Experts):
    """`moe.Experts` (stacked HF `experts.gate_up_proj` [E, 2I, hidden] / `experts.down_proj` [E, hidden, I],
    per-expert or stacked names) with GELU-tanh gates; batched by expert, never a loop over tokens."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights [T, k] fp32, experts [T, k] -> [T, hidden]: each expert runs once on its rows."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MoE layers run eagerly (the rows per expert are read on the host): CUDA graph "
                               "capture is not supported, run with --enforce-eager")
        num_tokens, k = experts.shape
        flat = experts.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # [T * k] the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # rows of each expert (host)
        rows = x[order // k]  # [T * k, hidden]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = F.linear(rows[start:start + n], self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
                out[start:start + n] = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
                start += n
        out = (out * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)  # [T * k, hidden] weighted (fp32 product)
        pairs = torch.empty_like(out).index_copy_(0, order, out)  # [T * k, hidden] in (token, slot) order
        return pairs.view(num_tokens, k, x.shape[-1]).sum(1)  # [T, hidden]


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, shared: bool, dtype: torch.dtype, device) -> None:
        super().__init__()
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Gemma4Attention(cfg, layer_id, shared=shared, dtype=dtype, device=device)
        wide = cfg.use_double_wide_mlp and shared
        self.mlp = Gemma3MLP(replace(cfg, intermediate_size=2 * cfg.intermediate_size) if wide else cfg, dtype=dtype,
                             device=device)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Gemma4RMSNorm(cfg.hidden_size, **norm))
        self.layer_scalar = _param((1,), dtype=dtype, device=device)  # [1]
        self.moe = cfg.num_experts > 0
        if self.moe:
            self.router = Gemma4Router(cfg, dtype=dtype, device=device)
            self.experts = Gemma4Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype=dtype,
                                         device=device)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                setattr(self, name, Gemma4RMSNorm(cfg.hidden_size, **norm))
        self.per_layer = cfg.hidden_size_per_layer_input
        if self.per_layer:
            self.per_layer_input_gate = Linear(cfg.hidden_size, self.per_layer, bias=False, dtype=dtype, device=device)
            self.per_layer_projection = Linear(self.per_layer, cfg.hidden_size, bias=False, dtype=dtype, device=device)
            self.post_per_layer_input_norm = Gemma4RMSNorm(cfg.hidden_size, **norm)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttnMetadata, kv_cache: KVCache) -> torch.Tensor:  # residual [T, hidden] -> [T, hidden]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache))
        h = self.mlp(self.pre_feedforward_layernorm(x))  # [T, hidden]
        if self.moe:
            weights, experts = self.router(x)  # [T, k] each, routed from the residual
            moe = self.experts(self.pre_feedforward_layernorm_2(x), weights, experts)  # [T, hidden]
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer:
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input  # [T, P]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        owners, index = kv_layout(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i, shared=index[i] != i, dtype=dtype, device=device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = Gemma4RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.rotary_emb = Gemma4Rotary(cfg, device=device)
        self.embed_scale, self.projection_scale = float(cfg.hidden_size) ** 0.5, cfg.hidden_size ** -0.5
        L, P = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        self.per_layer_shape = (L, P)
        if P:
            self.embed_tokens_per_layer = VocabEmbedding(cfg.vocab_size_per_layer_input or cfg.vocab_size, L * P,
                                                         dtype=dtype, device=device)
            self.per_layer_model_projection = Linear(cfg.hidden_size, L * P, bias=False, dtype=dtype, device=device)
            self.per_layer_projection_norm = Gemma4RMSNorm(P, eps=cfg.rms_norm_eps, dtype=dtype, device=device)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """input_ids [T], the scaled embedding x [T, hidden] -> each layer's input [T, L, P] (None: none)."""
        L, P = self.per_layer_shape
        if not P:
            return None
        T = x.shape[0]
        tokens = self.embed_tokens_per_layer(input_ids)  # [T, L * P]
        tokens = (tokens * _rounded(float(P) ** 0.5, tokens.dtype)).view(T, L, P)
        proj = self.per_layer_model_projection(x) * self.projection_scale  # [T, L * P]
        proj = self.per_layer_projection_norm(proj.view(T, L, P))  # [T, L, P]
        return (proj + tokens) * 2.0 ** -0.5


class Gemma4ForCausalLM(MoeWeights, LlamaForCausalLM):
    """Loading (HF names, fused q|k|v and gate|up, stacked experts) and taps as `LlamaForCausalLM`; the pool
    holds one entry per layer that owns K/V (`kv_layer_specs`)."""

    model_cls = Gemma4Model

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(cfg, dtype=dtype, device=device)
        self.kv_owners, self.cache_index = kv_layout(cfg)
        self._layer_kinds = {cfg.layer_type(i) for i in range(cfg.num_hidden_layers)}

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_owners)

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        """(KV heads, head_dim) of each pool entry: sliding and full layers differ."""
        return [layer_shape(self.config, self.config.layer_type(i)) for i in self.kv_owners]

    def stack_rows(self) -> int:
        return 0  # the one-call CPU stacks know neither KV sharing nor per-kind head shapes

    def _stack_applies(self, x: torch.Tensor, meta: AttnMetadata, kv_caches: list[KVCache]) -> bool:
        return False

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] long
        positions: torch.Tensor,  # [num_tokens] long
        attn_meta: AttnMetadata,
        kv_caches: list[KVCache],
        tap_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final-normed hidden [num_tokens, hidden], taps [num_tokens, len(tap_layer_ids) * hidden] or
        None); tap -1 is the scaled embedding, tap i layer i's output (after its layer_scalar)."""
        m = self.model
        if len(kv_caches) != self.num_kv_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {self.num_kv_layers} layers owning K/V")
        x = m.embed_tokens(input_ids)  # [T, hidden]
        x = x * _rounded(m.embed_scale, x.dtype)
        per_layer = m.per_layer_inputs(input_ids, x)  # [T, L, P] or None
        tables = {kind: m.rotary_emb.lookup(positions, kind, x.dtype) for kind in self._layer_kinds}
        taps, tap_slots, capture = self._tap_buffer(x, tap_layer_ids)
        for i, layer in enumerate(m.layers):
            x = layer(x, None if per_layer is None else per_layer[:, i], *tables[layer.self_attn.layer_type],
                      attn_meta, kv_caches[self.cache_index[i]])
            capture(i, x)
        return m.norm(x), taps

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] fp32
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # -- weights ------------------------------------------------------------------------------------
    def _hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """A multimodal folder's `model.language_model.*` as the decoder's names, its towers skipped; the k/v
        projections and norms some checkpoints keep for KV-shared layers (unused there) skipped."""
        towers = 0
        for name, tensor in weights:
            name = name.replace("model.language_model.", "model.", 1)
            if SKIPPED_WEIGHTS.search(name):
                towers += 1
                continue
            m = _SHARED_LAYER_KV.match(name)
            if m is not None and self.cache_index[int(m.group(1))] != int(m.group(1)):
                continue
            yield name, tensor
        if towers:
            log.info("%s: skipped %d checkpoint tensors of the vision / audio towers (text decoder only)",
                     self.config.architecture, towers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> set[str]:
        return super().load_weights(self._hf_weights(weights), strict=strict)


FAMILY = ModelFamily(
    architecture="Gemma4ForCausalLM", model_class=Gemma4ForCausalLM, model_types=("gemma4_text", "gemma4"),
    hf_architectures=("Gemma4ForConditionalGeneration",), from_hf=lambda hf: ModelConfig(**gemma4_fields(hf)),
    to_hf=gemma4_to_hf, qk_norm=True, mtp="assistant",
    no_tensor_parallel="per-kind head shapes, KV sharing and per-layer inputs are not split over ranks",
    no_layer_view="its KV sharing and per-layer inputs span every layer",
    gguf_names=("gemma4",), gguf=GEMMA4_GGUF, gguf_blocks=True)
