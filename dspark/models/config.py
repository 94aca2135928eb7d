"""ModelConfig: the target (or draft-model) architecture, normalised once from an HF config.json or a
GGUF header, so the rest of the package reads one set of field names.

`ModelConfig.from_hf` reads a config.json through its family's record (`dspark.models.family`: by `architectures`,
else `model_type`); a record without its own reader reads Llama's field names (`llama_style_config`), and
`to_hf` writes them back the same way. The family-specific readers live in the family modules (`gemma3.py`,
`gemma4_hf.py`, `qwen3_moe.py`, `qwen3_next.py`).

Gemma 3 adds per-layer attention kinds (`layer_types`: "sliding_attention" layers see the last
`sliding_window` positions, "full_attention" layers everything), a RoPE base per kind (`rope_theta`
global, `rope_local_theta` local; `rope_scaling` applies to the global layers only), the attention
scale `query_pre_attn_scalar ** -0.5`, the GELU-tanh MLP and optional final logit softcapping.

Hybrid targets (Qwen3-Next, Qwen3.5 dense and MoE) add "linear_attention" layers (Gated DeltaNet: `linear_*`
sizes, the conv kernel), partial RoPE and the attention output gate.

Mixture-of-experts families (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE) add the router and expert sizes; `is_moe_layer(i)` is transformers'
rule for which decoder layers hold a sparse MoE block (the others a dense MLP of `intermediate_size`).

Gemma 4 adds per-kind head shapes (`global_head_dim`, `num_global_key_value_heads`), K = V full layers, KV shared
by the last layers, per-layer inputs and the double-wide MLP; its MoE block uses the fields above."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark.models.family import architectures_with, family_for_model_type, family_of, served_architectures

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a registered family's (dspark.models.family)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling / rope_parameters (llama3 type supported)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm on q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3 (the defaults are the Llama/Qwen3 behaviour)
    hidden_activation: str = "silu"  # "gelu_pytorch_tanh" for Gemma
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all full
    sliding_window: int | None = None  # a sliding layer's query at p sees keys (p - window, p]
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # mixture of experts (the defaults are a dense model)
    num_experts: int = 0  # routed experts of a MoE layer
    num_experts_per_tok: int = 0  # top-k experts a token is routed to
    moe_intermediate_size: int = 0  # one expert's gated-MLP width
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to 1
    decoder_sparse_step: int = 1  # every step-th layer is a MoE layer ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep the dense MLP
    shared_expert_intermediate_size: int = 0  # an always-on gated shared expert's width (0: none)
    # hybrid targets (Qwen3-Next, Qwen3.5): "linear_attention" layers are Gated DeltaNet (dspark.models.recurrent)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of each head
    attn_output_gate: bool = False  # full attention's q_proj also gives a per-channel sigmoid output gate
    # Gemma 4 (dspark.models.gemma4): full layers' own head shape, K = V there, KV sharing, per-layer inputs
    global_head_dim: int = 0  # a full-attention layer's head_dim (0: head_dim)
    num_global_key_value_heads: int = 0  # a full-attention layer's KV heads (0: num_key_value_heads)
    attention_k_eq_v: bool = False  # full layers have no v_proj: the key projection is the value
    num_kv_shared_layers: int = 0  # the last layers read the K/V of the last earlier layer of their kind
    hidden_size_per_layer_input: int = 0  # per-layer input width (0: none)
    vocab_size_per_layer_input: int = 0  # rows of the per-layer input embedding
    use_double_wide_mlp: bool = False  # KV-shared layers' MLP is 2 * intermediate_size wide

    def __post_init__(self) -> None:
        if self.architecture not in served_architectures():
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(served_architectures())}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.layer_types and len(self.layer_types) < self.num_hidden_layers:  # longer: a truncated view
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has "
                             f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types {bad} are not supported; supported: {', '.join(LAYER_TYPES)}")
        if "linear_attention" in self.layer_types and not family_of(self.architecture).recurrent_state:
            raise ValueError(f"linear_attention layers need a hybrid architecture "
                             f"({', '.join(architectures_with('recurrent_state'))})")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding_attention layers need a positive sliding_window, got {self.sliding_window}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
                                     and self.decoder_sparse_step > 0):
            raise ValueError(f"MoE needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                             f"({self.num_experts}), moe_intermediate_size > 0 ({self.moe_intermediate_size}) and "
                             f"decoder_sparse_step > 0 ({self.decoder_sparse_step})")

    def is_moe_layer(self, i: int) -> bool:
        """Does decoder layer i hold a sparse MoE block (transformers' rule)?"""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    def layer_type(self, i: int) -> str:
        """Attention kind of decoder layer i (a layer-truncated view reads a prefix of the list)."""
        return self.layer_types[i] if self.layer_types else "full_attention"

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From an HF config.json dict, read by its family's record (`architectures`, else `model_type`)."""
        archs = hf.get("architectures") or []
        if not archs:
            mt = hf.get("model_type")
            fam = family_for_model_type(mt)
            archs = [fam.architecture if fam else str(mt)]
        arch = archs[0]
        fam = family_of(arch)
        if fam is None:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(served_architectures())}")
        return fam.from_hf(hf) if fam.from_hf is not None else llama_style_config(hf, fam.architecture,
                                                                                  qk_norm=fam.qk_norm)

    def to_hf(self) -> dict[str, Any]:
        """An HF config.json dict (used to build the transformers reference in tests), by its family's record."""
        fam = family_of(self.architecture)
        return fam.to_hf(self) if fam.to_hf is not None else llama_style_hf(self, fam.model_types[0])


def llama_style_config(hf: dict[str, Any], architecture: str, *, qk_norm: bool, **extra: Any) -> ModelConfig:
    """A ModelConfig from Llama's config.json field names (Qwen3's are the same); `extra`: fields a family adds
    (Qwen3-MoE's experts)."""
    heads = hf["num_attention_heads"]
    rope_scaling = hf.get("rope_scaling")
    rope_theta = hf.get("rope_theta")
    params = hf.get("rope_parameters")  # transformers >= 5 nests theta and scaling here
    if isinstance(params, dict):
        rope_theta = params.get("rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default":
            rope_scaling = params
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=qk_norm,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id")),
        **extra,
    )


def llama_style_hf(c: ModelConfig, model_type: str) -> dict[str, Any]:
    """Llama's config.json field names for `c`, under `model_type`."""
    out = {
        "architectures": [c.architecture],
        "model_type": model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias,
        "hidden_act": "silu", "bos_token_id": c.bos_token_id,
        "eos_token_id": hf_eos(c.eos_token_ids),
    }
    if c.rope_scaling:
        out["rope_scaling"] = dict(c.rope_scaling)
    return out


def dense_width(c: ModelConfig) -> int:
    """The gated-MLP width a dense drafter layer copies from the target: its dense MLP's, else (a target whose
    every layer is MoE) the width of the experts a token runs, shared expert included."""
    return c.intermediate_size or c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size


def eos_ids(eos: Any) -> tuple[int, ...]:
    """config.json's `eos_token_id` (an id, a list or none) as a tuple."""
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def hf_eos(ids: tuple[int, ...]) -> int | list[int]:
    """The reverse of `eos_ids`: one id as itself, else a list."""
    return list(ids) if len(ids) != 1 else ids[0]
