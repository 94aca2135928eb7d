"""Gemma 4 text-decoder fields of `ModelConfig` read from, and written as, an HF config.json: `Gemma4TextConfig`
(model_type `gemma4_text`) or a multimodal `Gemma4Config` (`Gemma4ForConditionalGeneration`), whose `text_config`
is the decoder dspark serves. Kept out of `gemma4.py` (whose `FAMILY` record reads and writes through it) and
importing nothing of dspark.

What the dict says and where it goes:
* `layer_types` (default: 5 sliding to 1 full; transformers forces the last layer to full attention, so do we);
* per-kind head sizes: a full layer's head is `global_head_dim` (default 512) with `num_global_key_value_heads`
  (only where `attention_k_eq_v`), or, in a config written by transformers 5.x, the `per_layer_config` overrides
  of each full layer (`head_dim`, `num_key_value_heads`; a sliding layer takes none);
* `rope_parameters` per kind: the sliding layers' base goes to `rope_local_theta` (default RoPE only), the full
  layers' base to `rope_theta` and, when not default (proportional, partial rotary), the dict to `rope_scaling`;
* attention scale 1.0 (`query_pre_attn_scalar` 1.0), K = V full layers, KV shared by the last layers,
  per-layer inputs, the double-wide MLP of shared layers and the MoE block (`enable_moe_block`: `num_experts`,
  `top_k_experts`, `moe_intermediate_size`; the top-k weights are always renormalised).
"""

from __future__ import annotations

from typing import Any

_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}
_OVERRIDES = {"head_dim", "num_key_value_heads"}  # the per_layer_config keys a full layer may set


def _eos(eos: Any) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _full_layer_heads(hf: dict[str, Any], layer_types: list[str], head_dim: int, kv: int) -> tuple[int, int]:
    """(head_dim, KV heads) of the full-attention layers."""
    per_layer = hf.get("per_layer_config")
    if not per_layer:
        g_kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
        return int(hf.get("global_head_dim") or 512), int(g_kv or kv)
    seen = set()
    for i, kind in enumerate(layer_types):
        o = per_layer.get(str(i), per_layer.get(i)) or {}
        if set(o) - _OVERRIDES:
            raise ValueError(f"Gemma 4 per_layer_config of layer {i} sets {sorted(set(o) - _OVERRIDES)}; "
                             f"supported: {', '.join(sorted(_OVERRIDES))}")
        if kind == "sliding_attention" and o:
            raise ValueError(f"Gemma 4 per_layer_config overrides sliding layer {i} ({o}): not supported")
        if kind == "full_attention":
            seen.add((int(o.get("head_dim", head_dim)), int(o.get("num_key_value_heads", kv))))
    if len(seen) != 1:
        raise ValueError(f"Gemma 4 full-attention layers of several head shapes {sorted(seen)}: not supported")
    return seen.pop()


def gemma4_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` keyword arguments of a Gemma4TextConfig dict (or a Gemma4Config's `text_config`)."""
    if "text_config" in hf:
        hf = {**{k: v for k, v in hf.items() if k in ("tie_word_embeddings", "eos_token_id", "bos_token_id")},
              **hf["text_config"]}
    if hf.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with use_bidirectional_attention='all' (not causal) is not supported")
    layers = hf["num_hidden_layers"]
    layer_types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                                 for i in range(layers)])
    layer_types[layers - 1] = "full_attention"  # transformers' rule
    params = hf.get("rope_parameters") or _DEFAULT_ROPE
    local = params.get("sliding_attention") or _DEFAULT_ROPE["sliding_attention"]
    full = params.get("full_attention") or _DEFAULT_ROPE["full_attention"]
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling on Gemma 4 sliding layers ({local}) is not supported")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    g_head_dim, g_kv = _full_layer_heads(hf, layer_types, head_dim, kv)
    per_layer = int(hf.get("hidden_size_per_layer_input", 256) or 0)
    moe: dict[str, Any] = {}
    if hf.get("enable_moe_block"):
        moe = dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["top_k_experts"]),
                   moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True)
    return dict(
        architecture="Gemma4ForCausalLM", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_scaling={k: v for k, v in full.items() if k != "rope_theta"} if full.get("rope_type", "default") != "default"
        else None,
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
        bos_token_id=hf.get("bos_token_id", 2), eos_token_ids=_eos(hf.get("eos_token_id", 1)),
        hidden_activation=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        layer_types=tuple(layer_types), sliding_window=hf.get("sliding_window", 512),
        rope_local_theta=float(local.get("rope_theta", 10_000.0)), query_pre_attn_scalar=1.0,
        final_logit_softcapping=hf.get("final_logit_softcapping"), global_head_dim=g_head_dim,
        num_global_key_value_heads=g_kv, attention_k_eq_v=bool(hf.get("attention_k_eq_v", False)),
        num_kv_shared_layers=int(hf.get("num_kv_shared_layers") or 0),
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=int(hf.get("vocab_size_per_layer_input", 262_144)) if per_layer else 0,
        use_double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)), **moe)


def gemma4_to_hf(c: Any) -> dict[str, Any]:
    """The Gemma4TextConfig dict of a Gemma 4 `ModelConfig` (tests build the transformers reference from it)."""
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:
        full = {**dict(c.rope_scaling), "rope_theta": c.rope_theta}
    layer_types = list(c.layer_types[:c.num_hidden_layers])
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias, "hidden_activation": c.hidden_activation,
        "bos_token_id": c.bos_token_id, "pad_token_id": 0,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
        "layer_types": layer_types, "sliding_window": c.sliding_window,
        "final_logit_softcapping": c.final_logit_softcapping,
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
        "per_layer_config": {str(i): {"head_dim": c.global_head_dim, "num_key_value_heads": c.num_global_key_value_heads}
                             for i, kind in enumerate(layer_types) if kind == "full_attention"},
        "attention_k_eq_v": c.attention_k_eq_v, "num_kv_shared_layers": c.num_kv_shared_layers,
        "hidden_size_per_layer_input": c.hidden_size_per_layer_input,
        "vocab_size_per_layer_input": c.vocab_size_per_layer_input or c.vocab_size, "use_double_wide_mlp": c.use_double_wide_mlp,
        "enable_moe_block": bool(c.num_experts), "num_experts": c.num_experts or None,
        "top_k_experts": c.num_experts_per_tok or None, "moe_intermediate_size": c.moe_intermediate_size or None,
    }
