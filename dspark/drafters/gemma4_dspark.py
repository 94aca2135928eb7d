"""Gemma4DSparkModel: the DSpark / DFlash block drafter with Gemma 4 draft layers (DeepSpec's Gemma 4 variant,
the drafters published for Gemma-4-E2B / E4B), and the HF folder it is read from (config.json architecture
"Gemma4DSparkModel", the layout llama.cpp's converter reads).

The DSpark machinery is `DSparkModel`'s, unchanged: H_ctx = hidden_norm(fc(taps)) feeds every layer's context K/V,
the block [anchor, mask × (block_size - 1)] attends to its context and to itself both ways, the final norm, the LM
head (the target's, tied), the Markov head and the confidence head over [norm(h) ; W1[prev]]. The draft layer is
Gemma 4's full-attention layer, op for op as llama.cpp's dflash graph runs it (`src/models/dflash.cpp`):

    rows  = embed(ids) * sqrt(hidden)                                   (rounded to the embedding's dtype)
    x     = input_layernorm(h)
    q     = rope(q_norm(W_q x))                       heads × global_head_dim
    k     = rope(k_norm(W_k y)), v = rms(W_k y)       y = H_ctx (context rows) or x (block rows): K = V, one
                                                      projection, v its weightless RMS norm before k_norm / RoPE;
                                                      num_global_key_value_heads × global_head_dim
    h     = h + post_attention_layernorm(o_proj(softmax(q k^T * 1.0) v))    (attention scale 1.0)
    h     = (h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))) * layer_scalar
    mlp   = down(gelu_tanh(gate(x)) * up(x))

RoPE: the full layers' (proportional: the first `partial_rotary_factor` of each half rotates at `rope_theta`, the
rest keeps frequency 0 — llama.cpp's `rope_freqs` of 1 and 1e30 — or default). Every RMSNorm multiplies by its stored
weight (Gemma 4's convention, no 1 + weight: transformers' Gemma4RMSNorm, and neither llama.cpp's Gemma 4 nor its
DSpark converter shifts them); norms, RoPE table and the weightless v norm are `models.gemma4`'s. The CPU kernels'
fused decoder stack is Qwen3's layer (SiLU, its own V, no sandwich norms), so this network always runs the module
path.

The HF folder (`gemma4_dspark_json`): a Gemma 4 text config (`global_head_dim`, `num_global_key_value_heads`,
`attention_k_eq_v`, `layer_types`, `hidden_activation`, `rope_parameters` per kind or flat) plus DSpark's keys
(`block_size`, `mask_token_id` and `target_layer_ids` at the top or in `dflash_config`, `sample_from_anchor`
(default true: the anchor predicts), `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`, optional `num_target_layers`: the target's is used where it is absent). Tensors as
DeepSpec names them, with or without a `model.` prefix; `layers.<i>.layer_scalar` [1], and the confidence head as
`confidence_proj.*` (or `confidence_head.proj.*`). Refused by name: what llama.cpp's converter refuses too (K ≠ V,
other layer types, another activation, attention biases, MoE, a reduced draft vocabulary, soft-capped logits, RoPE
other than default / proportional) and what the network lacks (sliding-window or causal draft attention, a value
scale, DFlash2's convolutions). A learned mask row (`mask_embedding.pt`) is not read from a folder; the GGUF the
converter writes from it carries the patched embedding, which loads as the drafter's own.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark.drafters.dspark_config import DRAFT_LAYERS, DSparkConfig
from dspark.drafters.dspark_model import DSparkAttention, DSparkModel, _MLP, _apply_rope
from dspark.kernels import Linear
from dspark.models.gemma3 import _rounded
from dspark.models.gemma4 import ROPE, Gemma4RMSNorm, _plain_rms

ARCHITECTURE = "Gemma4DSparkModel"
LAYERS = "gemma4"  # DSparkConfig.draft_layers
_ROPE_TYPES = ("default", "proportional")
# transformers' Gemma4TextConfig default for the full layers, where rope_parameters is absent
_DEFAULT_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}


# -- the HF folder ----------------------------------------------------------------------------------------------
def _dspark_key(d: dict[str, Any], key: str, default: Any = None) -> Any:
    """A DSpark key, from `dflash_config` where it is nested there, else the top level."""
    value = (d.get("dflash_config") or {}).get(key, d.get(key))
    return default if value is None else value


def _activation(d: dict[str, Any]) -> str:
    return d.get("hidden_activation") or d.get("hidden_act") or DRAFT_LAYERS[LAYERS]


# (what dspark's Gemma 4 DSpark network does not run, whether the config asks for it), checked in order
_REFUSED: tuple[tuple[str, Callable[[dict[str, Any]], bool]], ...] = (
    ("a separate V projection (attention_k_eq_v false; llama.cpp's converter requires K = V)",
     lambda d: not d.get("attention_k_eq_v", False)),
    ("draft layers other than full attention (layer_types)",
     lambda d: d.get("layer_types") != ["full_attention"] * int(d["num_hidden_layers"])),
    ("attention biases", lambda d: bool(d.get("attention_bias", False))),
    ("a MoE block (enable_moe_block)", lambda d: bool(d.get("enable_moe_block", False))),
    ("a reduced draft vocabulary (draft_vocab_size)",
     lambda d: (d.get("draft_vocab_size") or d["vocab_size"]) != d["vocab_size"]),
    ("final logit soft-capping", lambda d: bool(_dspark_key(d, "final_logit_softcapping"))),
    ("sliding-window draft attention (use_swa)",
     lambda d: bool(_dspark_key(d, "use_swa")) or bool(d.get("use_sliding_window"))),
    ("causal draft attention", lambda d: bool(d.get("is_causal", _dspark_key(d, "causal")))),
    ("an attention value scale", lambda d: _dspark_key(d, "attention_value_scale") is not None),
    ("a logit scale (output_multiplier)", lambda d: _dspark_key(d, "output_multiplier") is not None),
    ("DFlash2's convolutions and candidate selector", lambda d: _dspark_key(d, "conv_kernel_size") is not None),
)


def _full_rope(d: dict[str, Any]) -> dict[str, Any]:
    """The full-attention layers' rope_parameters (per kind, or one flat dict, or Gemma 4's default)."""
    rope = d.get("rope_parameters") or {"full_attention": dict(_DEFAULT_ROPE)}
    full = rope.get("full_attention", rope)
    if full.get("rope_type", "default") not in _ROPE_TYPES:
        raise ValueError(f"Gemma 4 DSpark drafter with RoPE {full.get('rope_type')!r}: only "
                         f"{' and '.join(_ROPE_TYPES)} are supported")
    return full


def gemma4_dspark_json(d: dict[str, Any]) -> dict[str, Any]:
    """A `Gemma4DSparkModel` config.json → the DeepSpec-style keys `DSparkConfig.from_deepspec_json` reads (the
    full layers' head shape as head_dim / num_key_value_heads, draft_layers "gemma4"); what cannot run is refused by
    name. The target's depth is kept where the file names it (`num_target_layers`)."""
    if _activation(d) != DRAFT_LAYERS[LAYERS]:
        raise ValueError(f"Gemma 4 DSpark drafter with hidden_activation {_activation(d)!r}: only "
                         f"{DRAFT_LAYERS[LAYERS]} is supported")
    for what, asks in _REFUSED:
        if asks(d):
            raise ValueError(f"this Gemma 4 DSpark drafter has {what}, which dspark's Gemma 4 DSpark network "
                             "does not: not supported")
    full = _full_rope(d)
    out = {k: d[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_target_layers", "max_position_embeddings") if k in d}
    out.update(
        head_dim=d["global_head_dim"], num_key_value_heads=d["num_global_key_value_heads"],
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=full.get("rope_theta", _DEFAULT_ROPE["rope_theta"]),
        rope_scaling=None if full.get("rope_type", "default") == "default"
        else {k: v for k, v in full.items() if k != "rope_theta"},
        block_size=_dspark_key(d, "block_size", 16), mask_token_id=_dspark_key(d, "mask_token_id"),
        target_layer_ids=_dspark_key(d, "target_layer_ids"),
        slot_layout="dspark" if d.get("sample_from_anchor", True) else "zlab",
        markov_rank=int(_dspark_key(d, "markov_rank", 0)),
        markov_head_type=_dspark_key(d, "markov_head_type", "vanilla"),
        enable_confidence_head=bool(_dspark_key(d, "enable_confidence_head", False)),
        confidence_head_with_markov=bool(_dspark_key(d, "confidence_head_with_markov", True)),
        hidden_act=DRAFT_LAYERS[LAYERS], draft_layers=LAYERS)
    return out


def gemma4_dspark_tensor_name(name: str) -> str:
    """A Gemma4DSparkModel checkpoint's tensor name → ours (the `model.` prefix dropped, the confidence head's
    `confidence_proj` as `confidence_head.proj`)."""
    name = name.removeprefix("model.")
    return "confidence_head.proj." + name[len("confidence_proj."):] if name.startswith("confidence_proj.") else name


# -- the network --------------------------------------------------------------------------------------------------
def _norm(size: int, eps: float) -> Gemma4RMSNorm:
    return Gemma4RMSNorm(size, eps=eps, dtype=torch.float32, device=None)  # (on a `torch.device` context's device)


class Gemma4DSparkAttention(DSparkAttention):
    """K = V attention: `k_proj` only; its projection's weightless RMS norm is V, its k_norm'd, rotated copy K;
    scale 1.0 (the q / k norms scale the logits)."""

    def __init__(self, cfg: DSparkConfig):
        nn.Module.__init__(self)
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.scale, self.eps = 1.0, cfg.rms_norm_eps
        self.q_proj = Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = Linear(self.num_heads * hd, d, bias=False)
        self.q_norm, self.k_norm = _norm(hd, cfg.rms_norm_eps), _norm(hd, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., n, hidden] (H_ctx or the normed block) → k, v [..., n, kv_heads, head_dim]."""
        raw = self.k_proj(x).view(*x.shape[:-1], self.num_kv_heads, self.head_dim)
        return _apply_rope(self.k_norm(raw), cos, sin), _plain_rms(raw, self.eps)


class _GeluMLP(_MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4DSparkDecoderLayer(nn.Module):
    """Gemma 4's sandwich-normed layer (pre and post attention, pre and post feed-forward), its output times
    `layer_scalar` (a [1] buffer, as in transformers' Gemma 4)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, _norm(cfg.hidden_size, cfg.rms_norm_eps))
        self.self_attn = Gemma4DSparkAttention(cfg)
        self.mlp = _GeluMLP(cfg.hidden_size, cfg.intermediate_size)
        self.register_buffer("layer_scalar", torch.ones(1))  # [1]

    def forward(self, h, *, cos, sin, k_ctx, v_ctx, mask):  # h [batch, num_query, hidden]
        attn = self.self_attn(self.input_layernorm(h), cos=cos, sin=sin, k_ctx=k_ctx, v_ctx=v_ctx, mask=mask)
        h = h + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class Gemma4DSparkModel(DSparkModel):
    """`DSparkModel` with Gemma 4 draft layers, Gemma 4's norms and RoPE table, and the embedding scaled by
    sqrt(hidden); the CPU kernels' fused paths (Qwen3 layers) do not apply: `backbone`, `context_kv` and the
    per-op proposal run."""

    layer_cls = Gemma4DSparkDecoderLayer
    rope_table = ROPE

    def make_norm(self, size: int) -> nn.Module:
        return _norm(size, self.cfg.rms_norm_eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Block token ids [...] → embed(ids) * sqrt(hidden) [..., hidden] (the scale rounded to the embedding's dtype,
        as the Gemma 4 target scales its own), in the activations' dtype."""
        rows = self.embed_tokens(ids)
        return (rows * _rounded(math.sqrt(self.cfg.hidden_size), rows.dtype)).to(self.norm.weight.dtype)

    def _fused_weights(self) -> None:
        return None

    def _context_weights(self, num_rows: int) -> None:
        return None

    def fused_proposal_applies(self, num_rows: int) -> bool:
        return False

    def pack_layer_products(self) -> None:
        """Nothing to pack: only the fused stack reads the layers' product copies together."""
