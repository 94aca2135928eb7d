"""Gemma 3 target model (text: `Gemma3ForCausalLM` / `Gemma3TextConfig`, e.g. gemma-3-270m) over the
paged KV pool, with the same residual-stream taps as `llama.py`.

Differences from Llama, all from the config (`ModelConfig`'s Gemma fields):
* layers alternate local and global attention (`layer_types`): a sliding layer's query at position p
  reads keys (p - sliding_window, p] (`attention.sliding_window_metadata`), a full layer every key; each
  kind has its own RoPE base (`rope_local_theta` / `rope_theta`, scaling on the global layers only);
* per-head RMSNorm on q and k before RoPE, and the attention scale `query_pre_attn_scalar ** -0.5`;
* four norms per layer: input, post-attention (on the attention output, before the residual add),
  pre- and post-feed-forward; the MLP is GELU-tanh gated;
* RMSNorm multiplies by (1 + weight): the parameter holds the checkpoint's `weight` (HF convention;
  GGUF files store 1 + weight and the loader subtracts 1) and `scale` = 1 + weight is what the norm uses;
* the embedding output is multiplied by sqrt(hidden_size) (in the weights' dtype), the head is tied
  and the logits are soft-capped when `final_logit_softcapping` is set.

Every layer stores the K/V of every position (the pool has one block table per request for all layers),
so prefix caching, rollback and preemption work as for Llama; local layers only read fewer keys.
A CPU step of up to 128 rows (decode, verification, prompt chunks, a mix) runs every decoder layer in one
kernel call (`kernels.block_layers`, for matrices resident as GGUF blocks or fp32: the
per-layer modules' numbers bit for bit); other steps run the per-layer modules.

Its record (`FAMILY`) reads and writes `Gemma3TextConfig` (`gemma3_from_hf`, `gemma3_to_hf`) and names what a
llama.cpp Gemma 3 file differs by: four norms a layer (`GGUF_GEMMA3_BLOCK_NAMES`), norms stored as 1 + weight and
the header keys of `gguf_gemma3_fields`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.attention import AttnMetadata, one_group_metadata, paged_attention, sliding_window_metadata, store_kv
from dspark.models.config import ModelConfig, eos_ids, hf_eos
from dspark.models.family import ModelFamily
from dspark.models.gguf_format import GGUF_BLOCK_NAMES
from dspark.models.layers import (LMHead, Fp32Buffers, Linear, MergedLinear, RMSNorm, VocabEmbedding, apply_rope,
                                  default_weight_loader, rope_cos_sin, rope_type, ROPE_INIT)
from dspark.models.llama import KVCache, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """y = x / rms(x) * (1 + weight); `weight` is the checkpoint's, `scale` the factor applied."""

    def __init__(self, size: int, *, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(size, eps=eps, dtype=dtype, device=device)
        with torch.no_grad():
            self.weight.zero_()
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self.register_buffer("scale", torch.ones(size, dtype=dtype, device=device), persistent=False)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        default_weight_loader(param, loaded, shard_id)
        with torch.no_grad():  # HF: normed.float() * (1.0 + weight.float()), then cast back
            self.scale.copy_(1.0 + param.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        if x.dtype == torch.float32:
            from dspark import kernels
            return kernels.rms_norm(x.contiguous(), self.scale, self.eps)
        return (F.rms_norm(x.float(), self.shape, None, self.eps) * self.scale.float()).to(x.dtype)


class GemmaRotary(Fp32Buffers):
    """cos/sin of the global and the local RoPE, computed per step from the positions (no tables: at
    Gemma's 32k-128k contexts and head_dim 256 they would cost 30-130 MB each), rotate-half layout."""
    fp32_buffers = ("inv_freq_global", "inv_freq_local")

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str) -> None:
        super().__init__()
        kind = rope_type(cfg.rope_scaling)
        if kind not in ROPE_INIT:
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_INIT)}")
        inv_global = ROPE_INIT[kind](cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling or {}))
        inv_local = ROPE_INIT["default"](cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, {})
        self.register_buffer("inv_freq_global", inv_global.to(device), persistent=False)  # [hd/2] fp32
        self.register_buffer("inv_freq_local", inv_local.to(device), persistent=False)

    def lookup(self, positions: torch.Tensor, kind: str, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, 1, hd], the sign of rotate-half folded into sin."""
        inv = self.inv_freq_local if kind == "sliding_attention" else self.inv_freq_global
        return rope_cos_sin(positions, inv, dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, (("q", q_size), ("k", kv_size), ("v", kv_size)),
                                     bias=cfg.attention_bias, dtype=dtype, device=device)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype, device=device)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.q_size, self.qk_size = q_size, q_size + kv_size
        self.scale = cfg.attention_scale
        self.layer_type = cfg.layer_type(layer_id)
        self.window = cfg.sliding_window if self.layer_type == "sliding_attention" else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv_cache: KVCache) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * hd]
        q = self.q_norm(qkv[:, :self.q_size].contiguous().view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, self.q_size:self.qk_size].contiguous().view(-1, self.num_kv_heads, self.head_dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [T, H, hd], [T, Hkv, hd]
        v = qkv[:, self.qk_size:].view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, hd]
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, all_stored=meta.all_stored)
        if self.window is not None:
            meta = sliding_window_metadata(meta, self.window)
        out = paged_attention(q, k_cache, v_cache, meta, scale=self.scale)  # [T, H, hd]
        return self.o_proj(out.reshape(out.shape[0], -1))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 3 MLP activation {cfg.hidden_activation!r} is not supported")
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, (("gate", inter), ("up", inter)), bias=False,
                                         dtype=dtype, device=device)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, inter] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_id, dtype=dtype, device=device)
        self.mlp = Gemma3MLP(cfg, dtype=dtype, device=device)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv_cache: KVCache) -> torch.Tensor:  # residual stream [T, hidden] -> [T, hidden]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`, as a Python float: a product with it equals the product with the 0-dim
    `dtype` tensor (both computed in the activations' precision) without making that tensor in each step
    (a host-to-device copy on CUDA, inside a captured step too)."""
    return float(torch.tensor(value, dtype=dtype))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, dtype=dtype, device=device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.rotary_emb = GemmaRotary(cfg, device=device)
        self.embed_scale = float(cfg.hidden_size) ** 0.5


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loading (`load_weights`, HF names, fused q|k|v and gate|up) and taps as `LlamaForCausalLM`."""

    model_cls = Gemma3Model
    stack_gelu_tanh = True

    def _stack_norms(self, layer: nn.Module) -> list[torch.Tensor | None]:
        a = layer.self_attn  # the (1 + weight) factors the norms apply
        return [layer.input_layernorm.scale, a.q_norm.scale, a.k_norm.scale, layer.post_attention_layernorm.scale,
                layer.pre_feedforward_layernorm.scale, layer.post_feedforward_layernorm.scale]

    def _gemma_stack(self, x: torch.Tensor, tables: dict, meta: AttnMetadata, kv_caches: list[KVCache],
                     taps: torch.Tensor | None, tap_slots: dict[int, list[int]]) -> bool:
        """Every decoder layer in one `kernels.block_layers` call where the step allows (`_stack_applies`):
        local layers with the local RoPE and each query's own key window (the rows the per-layer attention
        reads); False: the modules run."""
        if not self._stack_applies(x, meta, kv_caches):
            return False
        meta = one_group_metadata(meta)
        T = x.shape[0]
        full = tables.get("full_attention", tables.get("sliding_attention"))  # a kind no layer has: unused
        local = tables.get("sliding_attention", full)
        rope = {False: tuple(t.view(T, -1) for t in full), True: tuple(t.view(T, -1) for t in local)}
        g = meta.groups[0]
        rows = {False: (g.token_index, g.key_limit, g.kv_slots)}
        rows[True] = rows[False]
        if any(self._local_layers):  # every local layer has the config's one window
            wg = sliding_window_metadata(meta, self.config.sliding_window).groups[0]
            rows[True] = wg.query_rows if wg.key_start is not None else (wg.token_index, wg.key_limit, wg.kv_slots)
        return self._block_layers(x, rope, meta, rows, self._local_layers, kv_caches, taps, tap_slots)

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Gemma3Model(cfg, dtype=dtype, device=device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None,
                              dtype=dtype, device=device)
        kinds = [cfg.layer_type(i) for i in range(cfg.num_hidden_layers)]
        self._layer_kinds = set(kinds)  # the RoPE tables a step needs
        self._local_layers = [k == "sliding_attention" for k in kinds]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] long
        positions: torch.Tensor,  # [num_tokens] long
        attn_meta: AttnMetadata,
        kv_caches: list[KVCache],
        tap_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final-normed hidden [num_tokens, hidden], taps [num_tokens, len(tap_layer_ids) * hidden] or
        None); tap -1 is the scaled embedding (HF hidden_states[0])."""
        m = self.model
        if len(kv_caches) != len(m.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(m.layers)} layers")
        x = m.embed_tokens(input_ids)  # [T, hidden]: the weights' dtype (fp32 rows from resident blocks)
        x = x * _rounded(m.embed_scale, x.dtype)  # HF scales by the factor in the activations' dtype
        tables = {kind: m.rotary_emb.lookup(positions, kind, x.dtype) for kind in self._layer_kinds}
        taps, tap_slots, capture = self._tap_buffer(x, tap_layer_ids)
        if self._gemma_stack(x, tables, attn_meta, kv_caches, taps, tap_slots):
            return m.norm(x), taps
        for i, (layer, kv_cache) in enumerate(zip(m.layers, kv_caches)):
            x = layer(x, *tables[layer.self_attn.layer_type], attn_meta, kv_cache)
            capture(i, x)
        return m.norm(x), taps

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] fp32
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# -- config.json and GGUF headers -----------------------------------------------------------------------------
def gemma3_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Gemma3TextConfig field names (transformers 4.5x flat rope keys or 5.x `rope_parameters` per
    layer kind)."""
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping (Gemma 2) is not supported")
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if not layer_types:
        pattern = hf.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    params = hf.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    theta = full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    scaling = hf.get("rope_scaling")
    if full.get("rope_type", "default") != "default":
        scaling = full
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling on Gemma 3 sliding layers ({local}) is not supported")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        architecture="Gemma3ForCausalLM", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta), rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
        bos_token_id=hf.get("bos_token_id", 2), eos_token_ids=eos_ids(hf.get("eos_token_id", 1)),
        hidden_activation=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        layer_types=tuple(layer_types), sliding_window=hf.get("sliding_window", 4096),
        rope_local_theta=float(local_theta),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
    )


def gemma3_to_hf(c: ModelConfig) -> dict[str, Any]:
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:
        full = {**dict(c.rope_scaling), "rope_theta": c.rope_theta}
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias,
        "hidden_activation": c.hidden_activation, "bos_token_id": c.bos_token_id,
        "eos_token_id": hf_eos(c.eos_token_ids),
        "pad_token_id": 0, "layer_types": list(c.layer_types[:c.num_hidden_layers]),
        "sliding_window": c.sliding_window, "query_pre_attn_scalar": _int_if_whole(c.query_pre_attn_scalar),
        "final_logit_softcapping": c.final_logit_softcapping, "attn_logit_softcapping": None,
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": c.rope_local_theta or c.rope_theta}},
    }


def _int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x


# llama.cpp's Gemma 3 names: four norms a layer, and ffn_norm is the pre-feed-forward one
GGUF_GEMMA3_BLOCK_NAMES = {
    **GGUF_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_gemma3_fields(get: Any, hidden: int, heads: int, layers: int) -> dict[str, Any]:
    """The Gemma 3 ModelConfig fields a GGUF header implies, as llama.cpp reads them: every 6th layer
    global, local RoPE base 10000, attention scale 1/sqrt(head_dim) except gemma-3-27b (62 layers:
    1/sqrt(hidden / heads)), GELU-tanh, no logit softcapping (Gemma 3 has none). (llama.cpp's linear RoPE
    scaling applies to the global layers only, as `rope_scaling` does here.)"""
    head_dim = int(get("attention.key_length", hidden // heads))
    return dict(
        hidden_activation="gelu_pytorch_tanh",
        layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)),
        sliding_window=int(get("attention.sliding_window")),
        rope_local_theta=10_000.0,
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        final_logit_softcapping=get("final_logit_softcapping", None),
    )


FAMILY = ModelFamily(
    architecture="Gemma3ForCausalLM", model_class=Gemma3ForCausalLM, model_types=("gemma3_text",),
    from_hf=gemma3_from_hf, to_hf=gemma3_to_hf, qk_norm=True,
    gguf_names=("gemma3",), gguf_norm_offset=True, gguf_blocks=True,
    gguf_tensor_names=GGUF_GEMMA3_BLOCK_NAMES, gguf_fields=gguf_gemma3_fields)
