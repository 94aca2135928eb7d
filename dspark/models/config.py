"""ModelConfig: the target (or draft-model) architecture, normalised once from an HF config.json or a
GGUF header, so the rest of the package reads one set of field names.

Gemma 3 adds per-layer attention kinds (`layer_types`: "sliding_attention" layers see the last
`sliding_window` positions, "full_attention" layers everything), a RoPE base per kind (`rope_theta`
global, `rope_local_theta` local; `rope_scaling` applies to the global layers only), the attention
scale `query_pre_attn_scalar ** -0.5`, the GELU-tanh MLP and optional final logit softcapping.

Hybrid targets (Qwen3-Next, Qwen3.5 dense and MoE; `hybrid_from_hf`) add "linear_attention" layers (Gated
DeltaNet: `linear_*` sizes, the conv kernel), partial RoPE and the attention output gate; a multimodal Qwen3.5
folder's `text_config` is read as the text decoder's.

Mixture-of-experts families (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE) add the router and expert sizes; `is_moe_layer(i)` is transformers'
rule for which decoder layers hold a sparse MoE block (the others a dense MLP of `intermediate_size`).

Gemma 4 (`gemma4_hf`) adds per-kind head shapes (`global_head_dim`, `num_global_key_value_heads`), K = V full
layers, KV shared by the last layers, per-layer inputs and the double-wide MLP; its MoE block uses the fields above."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark.models.gemma4_hf import GEMMA4_ARCHITECTURES, gemma4_fields, gemma4_to_hf

HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM",
                           *HYBRID_ARCHITECTURES, "Gemma4ForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM",
                         *HYBRID_ARCHITECTURES, "Gemma4ForCausalLM")  # per-head q/k RMSNorm
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                "qwen3_moe": "Qwen3MoeForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
                "gemma4": "Gemma4ForConditionalGeneration"}
# HF architecture -> the text decoder dspark serves (a multimodal layout's text part)
HYBRID_FAMILIES = {"Qwen3NextForCausalLM": "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM": "Qwen3_5ForCausalLM",
                   "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForCausalLM",
                   "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                   "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # key of MODEL_REGISTRY
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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.layer_types and len(self.layer_types) < self.num_hidden_layers:  # longer: a truncated view
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has "
                             f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types {bad} are not supported; supported: {', '.join(LAYER_TYPES)}")
        if "linear_attention" in self.layer_types and self.architecture not in HYBRID_ARCHITECTURES:
            raise ValueError(f"linear_attention layers need a hybrid architecture ({', '.join(HYBRID_ARCHITECTURES)})")
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
        """From an HF config.json dict (Llama and Qwen3 field names)."""
        archs = hf.get("architectures") or []
        if not archs:
            mt = hf.get("model_type")
            archs = [_MODEL_TYPES.get(mt, str(mt))]
        arch = archs[0]
        if arch in GEMMA4_ARCHITECTURES:
            return cls(**gemma4_fields(hf))
        if arch not in SUPPORTED_ARCHITECTURES and arch not in HYBRID_FAMILIES:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch == "Gemma3ForCausalLM":
            return _gemma3_from_hf(hf)
        if arch in HYBRID_FAMILIES:
            return hybrid_from_hf(hf, arch)
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        params = hf.get("rope_parameters")  # transformers >= 5 nests theta and scaling here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        moe = _qwen3_moe_from_hf(hf) if arch == "Qwen3MoeForCausalLM" else {}
        return cls(
            architecture=arch,
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
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF config.json dict (used to build the transformers reference in tests)."""
        if self.architecture == "Gemma3ForCausalLM":
            return _gemma3_to_hf(self)
        if self.architecture in HYBRID_ARCHITECTURES:
            return hybrid_to_hf(self)
        if self.architecture == "Gemma4ForCausalLM":
            return gemma4_to_hf(self)
        out = {
            "architectures": [self.architecture],
            "model_type": "qwen3" if self.architecture.startswith("Qwen3") else "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "hidden_act": "silu", "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.architecture == "Qwen3MoeForCausalLM":
            out.update(_qwen3_moe_to_hf(self))
        return out


def dense_width(c: ModelConfig) -> int:
    """The gated-MLP width a dense drafter layer copies from the target: its dense MLP's, else (a target whose
    every layer is MoE) the width of the experts a token runs, shared expert included."""
    return c.intermediate_size or c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size


def _eos_ids(eos: Any) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _gemma3_from_hf(hf: dict[str, Any]) -> ModelConfig:
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
        bos_token_id=hf.get("bos_token_id", 2), eos_token_ids=_eos_ids(hf.get("eos_token_id", 1)),
        hidden_activation=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        layer_types=tuple(layer_types), sliding_window=hf.get("sliding_window", 4096),
        rope_local_theta=float(local_theta),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
    )


def _gemma3_to_hf(c: ModelConfig) -> dict[str, Any]:
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
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
        "pad_token_id": 0, "layer_types": list(c.layer_types[:c.num_hidden_layers]),
        "sliding_window": c.sliding_window, "query_pre_attn_scalar": _int_if_whole(c.query_pre_attn_scalar),
        "final_logit_softcapping": c.final_logit_softcapping, "attn_logit_softcapping": None,
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": c.rope_local_theta or c.rope_theta}},
    }


def _qwen3_moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a Qwen3MoeConfig (config.json says `num_experts`, transformers 5.x's `to_dict`
    `num_local_experts`); the rest reads as Qwen3's."""
    if hf.get("use_sliding_window"):
        raise ValueError("Qwen3-MoE with use_sliding_window is not supported")
    return dict(num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))


def _qwen3_moe_to_hf(c: ModelConfig) -> dict[str, Any]:
    return {"model_type": "qwen3_moe", "num_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size, "norm_topk_prob": c.norm_topk_prob,
            "decoder_sparse_step": c.decoder_sparse_step, "mlp_only_layers": list(c.mlp_only_layers),
            "use_sliding_window": False}


def _int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x


# -- hybrid linear-attention targets (Qwen3-Next, Qwen3.5 dense and MoE) ------------------------------------
_MODEL_TYPE = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5_text",
               "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"}
def _hybrid_moe(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE fields of a hybrid config: Qwen3-Next as Qwen3-MoE plus the shared expert; Qwen3.5-MoE routes
    every layer and always renormalises the top-k (its config has neither field); dense Qwen3.5 none."""
    if arch == "Qwen3_5ForCausalLM" or not hf.get("num_experts"):
        return {}
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    if arch == "Qwen3_5MoeForCausalLM":
        return dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True,
                    shared_expert_intermediate_size=shared)
    return {**_qwen3_moe_from_hf(hf), "shared_expert_intermediate_size": shared}


def hybrid_from_hf(hf: dict[str, Any], arch: str) -> ModelConfig:
    """Qwen3NextConfig / Qwen3_5TextConfig / Qwen3_5MoeTextConfig field names (a multimodal folder's
    `text_config`)."""
    if "text_config" in hf:
        hf = {**{k: v for k, v in hf.items() if k in ("tie_word_embeddings", "eos_token_id", "bos_token_id")},
              **hf["text_config"]}
    arch = HYBRID_FAMILIES[arch]
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
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        layer_types=tuple(layer_types), linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"], linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
        partial_rotary_factor=float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
        attn_output_gate=True, **_hybrid_moe(hf, arch))


def hybrid_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The text config.json of a hybrid target (tests build the transformers reference from it)."""
    out = {
        "architectures": [c.architecture], "model_type": _MODEL_TYPE[c.architecture],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias, "hidden_act": "silu", "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
        "layer_types": list(c.layer_types[:c.num_hidden_layers]),
        "linear_num_key_heads": c.linear_num_key_heads, "linear_num_value_heads": c.linear_num_value_heads,
        "linear_key_head_dim": c.linear_key_head_dim, "linear_value_head_dim": c.linear_value_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.partial_rotary_factor},
    }
    if c.architecture == "Qwen3NextForCausalLM":  # its defaults are MoE: a dense one says num_experts 0
        out.update(num_experts=c.num_experts, shared_expert_intermediate_size=c.shared_expert_intermediate_size)
        if c.num_experts:
            out.update({k: v for k, v in _qwen3_moe_to_hf(c).items() if k not in ("model_type", "use_sliding_window")})
    elif c.architecture == "Qwen3_5MoeForCausalLM":
        out.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size,
                   shared_expert_intermediate_size=c.shared_expert_intermediate_size)
        del out["intermediate_size"]
    return out
