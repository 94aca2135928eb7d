"""ModelConfig: the target (or draft-model) architecture, normalised once from an HF config.json or a
GGUF header, so the rest of the package reads one set of field names.

Gemma 3 adds per-layer attention kinds (`layer_types`: "sliding_attention" layers see the last
`sliding_window` positions, "full_attention" layers everything), a RoPE base per kind (`rope_theta`
global, `rope_local_theta` local; `rope_scaling` applies to the global layers only), the attention
scale `query_pre_attn_scalar ** -0.5`, the GELU-tanh MLP and optional final logit softcapping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM")  # per-head q/k RMSNorm
LAYER_TYPES = ("full_attention", "sliding_attention")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


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
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding_attention layers need a positive sliding_window, got {self.sliding_window}")

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
        if arch == "Gemma3ForCausalLM":
            return _gemma3_from_hf(hf)
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
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF config.json dict (used to build the transformers reference in tests)."""
        if self.architecture == "Gemma3ForCausalLM":
            return _gemma3_to_hf(self)
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
        return out


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


def _int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x
