"""Drafters from the GGUF files llama.cpp's converter (`convert_hf_to_gguf.py`) writes, one `GGUFDrafter` record per
`general.architecture` (`DRAFTERS`):

* `gemma4-assistant` (`Gemma4AssistantModel`: Gemma 4's assistant, `Gemma4AssistantForCausalLM`): method "mtp" on
  a Gemma 4 target (`gemma4_assistant.py`);
* `dflash` (`DFlashModel`, `DSparkModel`: z-lab's DFlash and DeepSpec's / dspark's DSpark block drafters on
  Qwen3-style layers; `Gemma4DSparkModel`: DeepSpec's DSpark drafters for Gemma 4 targets, Gemma 4 draft layers):
  methods "dspark" and "dflash" (`dspark.py`; the Gemma 4 layers' network in `gemma4_dspark.py`).

The drafter loaders read a GGUF file as they read a checkpoint folder: `checkpoint.read_config`, `header_shapes`,
`load_tensors` and `load_named` hand a `.gguf` path here and get the config.json dict an HF folder of the same
drafter would hold (`gguf_config`: read from the header alone, what dspark cannot run refused by name), the tensor
shapes from the header (`gguf_shapes`) and the tensors (`gguf_tensors`: dequantized with `gguf_format.gguf_values`,
fp32, HF names and layouts). Everything is checked against the target before a tensor's data is read, as for a
folder. `check_method` refuses a drafter GGUF given to a method that does not read it, by name.

What the converter does, and how it is undone here:
* both: llama.cpp's names (`blk.<i>.attn_q`, ...) and GGUF's dims order (the reverse of HF's [out, in]); no norm
  offset (Gemma 4's RMSNorm weight and Qwen3's are stored as they are), no row permutation (Gemma 4 and Qwen3 rotate
  halves, as llama.cpp's NeoX RoPE does: the converter only permutes checkpoints with `rope_is_neox_style: false`,
  into the rotate-half layout dspark's modules use);
* gemma4-assistant: the header keys of a Gemma 4 target (read by the Gemma 4 GGUF family's reader,
  `gguf_families.GEMMA4_GGUF`) plus `embedding_length_out` (the backbone hidden size) and `nextn_predict_layers`;
  `pre_projection` / `post_projection` as `nextn.*`; the full layers' proportional RoPE as `rope_freqs` (read into
  the config); the centroid head (`masked_embedding.*`) is dropped. It is not derivable (trained weights), and it
  only narrows the tied head to a few clusters: the file drafts with the full tied head, as llama.cpp does
  (`use_ordered_embeddings` false; the HF folder of an assistant with ordered embeddings drafts through them);
* dflash: the taps as `target_layers` counting the embedding output as 0 (tap = id - 1); the mask token as
  `tokenizer.ggml.mask_token_id`; `sample_from_anchor` (absent, as z-lab's DFlash files leave it: the anchor predicts
  nothing, the "zlab" slot layout); the Markov rank read off `markov_w1`, the confidence head's input off
  `conf_proj`; a reduced vocabulary's `d2t` as absolute target ids; a full-vocabulary LM head and `t2d` dropped (the
  target's head is used, as for a folder without one); `fc` / `hidden_norm` / `norm` as `fc` / `enc.output_norm` /
  `output_norm`;
* dflash with Gemma 4 layers (told apart by their `post_attention_norm` / `post_ffw_norm` / `layer_output_scale`):
  read into the `Gemma4DSparkModel` folder's config.json (`gemma4_dspark.gemma4_dspark_json` reads it as it reads
  the folder's) and names. `post_attention_layernorm` as `post_attention_norm`, `pre_feedforward_layernorm` as
  `ffn_norm` (Qwen's post-attention norm's name there), `layer_scalar` as `layer_output_scale`, `confidence_proj` as
  `conf_proj`; `global_head_dim` / `num_global_key_value_heads` as the key length and KV heads; the embedding scale
  sqrt(hidden), attention scale 1.0 and GELU-tanh as keys (checked, implied by the layout); proportional RoPE as
  `rope_freqs` (1 per rotated pair, 1e30 after: its partial rotary factor read into the config), default RoPE as
  none.

Refused by name, from the header, before any tensor's data: a GGUF of another architecture; in a dflash file
DeepSeek-V4 DSpark stages, DFlash2's convolutions and candidate selector, attention sinks, sliding-window or causal
draft attention, value / logit scales, soft-capping, quantization scale tensors, and any tensor without an HF name
here; with Qwen3-style layers also a GELU feed-forward, K = V attention, partial RoPE, `rope_freqs`, RoPE scaling
other than linear, scaled embeddings and an attention scale (`dspark_model.py` has none of them); with Gemma 4
layers also a separate V projection, another activation, layers lacking a sandwich norm or scalar, an embedding
scale other than sqrt(hidden), an attention scale other than 1.0, partial RoPE other than proportional's, RoPE
scaling and a reduced draft vocabulary (`d2t`: llama.cpp's converter refuses one for Gemma 4 DSpark too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from dspark.drafters.formats import GGUF_KEY
from dspark.drafters.gemma4_dspark import ARCHITECTURE as GEMMA4_DSPARK
from dspark.models.files import CONFIG_ERRORS, CheckpointError, config_error
from dspark.models.gguf_format import GGUF_BLOCK_NAMES
from dspark.models.gguf_families import GEMMA4_GGUF, Header
from dspark.models.gguf_format import GGMLType, gguf_field, gguf_reader, gguf_values


@dataclass(frozen=True)
class GGUFDrafter:
    what: str  # the drafter, for messages
    methods: tuple[str, ...]  # the speculative methods that read it
    config: Callable[[Header], dict[str, Any]]  # header -> the config.json dict of its HF folder (refusals raise)
    hf_name: Callable[[Header, str], str]  # (header, GGUF tensor name) -> HF name ("": the config holds it); KeyError: none


DRAFTERS: dict[str, GGUFDrafter] = {}


def register_gguf_drafter(arch: str, record: GGUFDrafter) -> None:
    DRAFTERS[arch] = record


# -- reading a file -----------------------------------------------------------------------------------------
def _reader(path: str | Path):
    """The file's parsed header (`gguf_format.gguf_reader`); a missing or damaged file is refused, naming it."""
    try:
        return gguf_reader(path)
    except FileNotFoundError:
        raise CheckpointError(f"drafter GGUF {str(path)!r} does not exist") from None
    except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: damaged GGUF file ({e})") from None


def _header(path: str | Path) -> tuple[Header, GGUFDrafter]:
    """The file's header and its record; a file of no drafter architecture is refused, naming it."""
    reader = _reader(path)
    arch = gguf_field(reader, "general.architecture")
    record = DRAFTERS.get(arch)
    if record is None:
        known = "; ".join(f"{a!r} ({r.what}, {_methods(r)})" for a, r in sorted(DRAFTERS.items()))
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not a drafter dspark reads; drafter GGUFs: {known}")
    return Header(reader, arch), record


def _methods(record: GGUFDrafter) -> str:
    names = [f"'{m}'" for m in record.methods]
    return f"method {names[0]}" if len(names) == 1 else f"methods {', '.join(names[:-1])} and {names[-1]}"


def gguf_config(path: str | Path) -> dict[str, Any]:
    """The config.json dict an HF folder of the file's drafter would hold (plus `GGUF_KEY`: its architecture),
    from the header alone; what dspark cannot run is refused by name."""
    h, record = _header(path)
    try:
        return {**record.config(h), GGUF_KEY: h.arch}
    except CONFIG_ERRORS as e:
        raise config_error(path, e) from None


def check_method(path: str | Path, method: str) -> None:
    """A drafter GGUF given to a method that does not read it is refused by name (a GGUF of no drafter
    architecture is left to the method's loader: the target's own file, for "mtp" on Qwen3.5)."""
    arch = gguf_field(_reader(path), "general.architecture")
    record = DRAFTERS.get(arch)
    if record is not None and method not in record.methods:
        raise ValueError(f"{path}: a {record.what} GGUF (architecture {arch!r}) drafts with {_methods(record)}, "
                         f"not {method!r}")


def _named(h: Header, record: GGUFDrafter, path) -> Iterable[tuple[Any, str]]:
    """(GGUF tensor, HF name) of every tensor the model reads (not those the config holds)."""
    for t in h.reader.tensors:
        try:
            name = record.hf_name(h, t.name)
        except KeyError:
            raise ValueError(f"{path}: GGUF tensor {t.name!r} has no equivalent in dspark's {record.what} "
                             "(not supported)") from None
        if name:
            yield t, name


def gguf_shapes(path: str | Path) -> dict[str, list[int]]:
    """Every tensor's HF name and HF shape (the reverse of its GGUF dims), from the header: no data read."""
    h, record = _header(path)
    return {name: [int(n) for n in reversed(t.shape)] for t, name in _named(h, record, path)}


def gguf_tensors(path: str | Path, *, skip: Iterable[str] = (), only: Iterable[str] | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The file's tensors by HF name (floating ones dequantized to fp32, then cast to `dtype` where given; d2t as
    its int64 ids); names starting with a `skip` prefix, or not in `only` where given, are not read."""
    h, record = _header(path)
    skip, only = tuple(skip), None if only is None else set(only)
    out = {}
    for t, name in _named(h, record, path):
        if (skip and name.startswith(skip)) or (only is not None and name not in only):
            continue
        if int(t.tensor_type) == GGMLType.I64:
            tensor = torch.from_numpy(np.array(t.data, dtype=np.int64))
        else:
            tensor = torch.from_numpy(np.array(gguf_values(t), dtype=np.float32, order="C"))
            tensor = tensor.to(dtype) if dtype is not None else tensor
        out[name] = tensor.reshape([int(n) for n in reversed(t.shape)]).to(device)
    return out


# -- gemma4-assistant ----------------------------------------------------------------------------------------
ASSISTANT_ARCHITECTURE = "Gemma4AssistantForCausalLM"
_ASSISTANT_NAMES = {"nextn.pre_projection.weight": "pre_projection.weight",
                    "nextn.post_projection.weight": "post_projection.weight"}


def _assistant_config(h: Header) -> dict[str, Any]:
    """The assistant's config.json: its decoder's keys as a Gemma 4 target file's header gives them, the backbone's
    hidden size, and no ordered embeddings (the converter drops the centroid head)."""
    text = GEMMA4_GGUF.hf_config(h)
    del text["architectures"]
    layers = text["num_hidden_layers"]
    if int(h.get("nextn_predict_layers", layers)) != layers:
        raise ValueError(f"nextn_predict_layers {h.get('nextn_predict_layers')} != block_count {layers}: every "
                         "layer of a Gemma 4 assistant drafts")
    return {"architectures": [ASSISTANT_ARCHITECTURE], "model_type": "gemma4_assistant",
            "backbone_hidden_size": int(h.get("embedding_length_out")), "use_ordered_embeddings": False,
            "tie_word_embeddings": text["tie_word_embeddings"], "text_config": {**text, "model_type": "gemma4_text"}}


def _assistant_name(h: Header, name: str) -> str:
    return _ASSISTANT_NAMES[name] if name in _ASSISTANT_NAMES else GEMMA4_GGUF.hf_name(name, None)


# -- dflash ---------------------------------------------------------------------------------------------------
# Two networks run a dflash file: Qwen3-style draft layers (`dspark_model.DSparkModel`; z-lab's DFlash, DeepSpec's
# and dspark's DSpark) and Gemma 4 draft layers (`gemma4_dspark.Gemma4DSparkModel`), told apart by the Gemma layer's
# own tensors. Each variant maps the names to its HF folder's and builds that folder's config.json.
_DFLASH_GLOBAL = {
    "fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight",
    "token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight", "d2t": "d2t",
    "markov_w1.weight": "markov_head.markov_w1.weight", "markov_w2.weight": "markov_head.markov_w2.weight",
    "conf_proj.weight": "confidence_head.proj.weight", "conf_proj.bias": "confidence_head.proj.bias",
}
_DFLASH_BLOCK = {f"{k}.weight": f"{v}.weight" for k, v in GGUF_BLOCK_NAMES.items()}  # llama.cpp's block names
# the Gemma 4 DSpark folder's names (`Gemma4DSparkModel`: the converter's renames undone; `rope_freqs` read into
# the config)
_GEMMA4_GLOBAL = {**{k: v for k, v in _DFLASH_GLOBAL.items() if k != "d2t"},
                  "conf_proj.weight": "confidence_proj.weight", "conf_proj.bias": "confidence_proj.bias",
                  "rope_freqs.weight": ""}
_GEMMA4_BLOCK = {**{k: v for k, v in _DFLASH_BLOCK.items() if k != "attn_v.weight"},
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
                 "layer_output_scale.weight": "layer_scalar"}
_GEMMA4_LAYER = ("blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.layer_output_scale.weight")
_GELU_TANH = "gelu_pytorch_tanh"


def _gemma4_layers(h: Header) -> bool:
    """Whether the file's draft layers are Gemma 4's (its sandwich norms or layer scalars)."""
    return any(name in h.tensors for name in _GEMMA4_LAYER)


def _dflash_name(h: Header, name: str) -> str:
    glob, block_map = (_GEMMA4_GLOBAL, _GEMMA4_BLOCK) if _gemma4_layers(h) else (_DFLASH_GLOBAL, _DFLASH_BLOCK)
    if name in glob:
        return glob[name]
    block, _, leaf = name.partition(".")[2].partition(".") if name.startswith("blk.") else ("", "", "")
    if not block.isdigit() or leaf not in block_map:
        raise KeyError(name)
    return f"layers.{block}.{block_map[leaf]}"


def _has(h: Header, key: str) -> bool:
    return h.field(f"{h.arch}.{key}") is not None


# (what neither network has, whether the file has it), checked in order: the first is named
_UNSUPPORTED: tuple[tuple[str, Callable[[Header], bool]], ...] = (
    ("DeepSeek-V4 DSpark stages (hyper-connections, MLA, experts)", lambda h: _has(h, "hyper_connection.count")),
    ("DFlash2's convolutions and candidate selector", lambda h: "selector_hidden.weight" in h.tensors
     or "blk.0.attn_conv_proj.weight" in h.tensors),
    ("attention sinks", lambda h: "blk.0.attn_sinks.weight" in h.tensors),
    ("sliding-window draft attention", lambda h: bool(h.get("attention.sliding_window", 0))),
    ("causal draft attention", lambda h: bool(h.get("attention.causal", False))),
    ("an attention value scale", lambda h: _has(h, "attention.value_scale")),
    ("a logit scale", lambda h: _has(h, "logit_scale")),
    ("final logit soft-capping", lambda h: _has(h, "final_logit_softcapping")),
    ("quantization scale tensors (*.scale)", lambda h: any(n.endswith(".scale") for n in h.tensors)),
)
_QWEN3_UNSUPPORTED: tuple[tuple[str, Callable[[Header], bool]], ...] = (
    ("a GELU feed-forward (hidden_activation)", lambda h: h.get("hidden_activation", "silu") != "silu"),
    ("K = V draft attention (no attn_v)", lambda h: "blk.0.attn_v.weight" not in h.tensors),
    ("partial RoPE", lambda h: _has(h, "rope.dimension_count")
     and int(h.get("rope.dimension_count")) != int(h.get("attention.key_length", 0))),
    ("per-dimension RoPE frequencies (rope_freqs)", lambda h: "rope_freqs.weight" in h.tensors),
    ("scaled embeddings (embedding_scale; the converter writes it for Gemma targets)",
     lambda h: _has(h, "embedding_scale")),
    ("an attention scale", lambda h: _has(h, "attention.scale")),
)
_GEMMA4_UNSUPPORTED: tuple[tuple[str, Callable[[Header], bool]], ...] = (
    ("a feed-forward activation other than gelu_pytorch_tanh", lambda h: h.get("hidden_activation", "") != _GELU_TANH),
    ("a separate V projection (attn_v)", lambda h: "blk.0.attn_v.weight" in h.tensors),
    ("a Gemma 4 layer without all of its sandwich norms and layer scalar",
     lambda h: not all(name in h.tensors for name in _GEMMA4_LAYER)),
    ("an embedding scale other than sqrt(embedding_length)", lambda h: not math.isclose(
        float(h.get("embedding_scale", 0.0)), math.sqrt(int(h.get("embedding_length"))), rel_tol=1e-6)),
    ("an attention scale other than 1.0", lambda h: float(h.get("attention.scale", 0.0)) != 1.0),
    ("partial RoPE other than proportional RoPE's (rope.dimension_count below key_length)",
     lambda h: int(h.get("rope.dimension_count", h.get("attention.key_length"))) != int(h.get("attention.key_length"))),
    ("RoPE scaling", lambda h: h.get("rope.scaling.type", "none") not in ("none", None)),
    ("a reduced draft vocabulary (d2t)", lambda h: "d2t" in h.tensors),
)


def _vocab_size(h: Header) -> int:
    """The target vocabulary: the file's own embedding or Markov W1 rows where it has one, else its tokenizer's."""
    for name in ("token_embd.weight", "markov_w1.weight"):
        if name in h.tensors:
            return h.dims(name)[1]
    tokens = h.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise KeyError("tokenizer.ggml.tokens")
    return int(getattr(tokens, "count", None) or len(tokens.data))


def _rope_scaling(h: Header) -> dict[str, Any] | None:
    kind = h.get("rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind != "linear":
        raise ValueError(f"this DFlash / DSpark GGUF has RoPE scaling {kind!r}; dspark's DSpark / DFlash network "
                         "reads linear scaling only: not supported")
    return {"rope_type": "linear", "factor": float(h.get("rope.scaling.factor"))}


def _refuse(h: Header, checks, network: str) -> None:
    """The first of `checks` the file has, refused by name; `network`: who lacks it ("dspark's ... does")."""
    for what, has in checks:
        if has(h):
            raise ValueError(f"this DFlash / DSpark GGUF has {what}, which {network} not: not supported")


def _dspark_keys(h: Header) -> dict[str, Any]:
    """The DSpark keys both layouts share: block, mask, taps, heads."""
    mask = h.field("tokenizer.ggml.mask_token_id")
    if mask is None:
        raise KeyError("tokenizer.ggml.mask_token_id")
    hidden = int(h.get("embedding_length"))
    rank = h.dims("markov_w1.weight")[0] if "markov_w1.weight" in h.tensors else 0
    conf = "conf_proj.weight" in h.tensors
    return {"vocab_size": _vocab_size(h), "hidden_size": hidden, "intermediate_size": int(h.get("feed_forward_length")),
            "num_hidden_layers": int(h.get("block_count")), "num_attention_heads": int(h.get("attention.head_count")),
            "rms_norm_eps": h.eps(), "max_position_embeddings": int(h.get("context_length")),
            "block_size": int(h.get("block_size")), "mask_token_id": int(mask),
            "target_layer_ids": [int(i) - 1 for i in h.get("target_layers")],
            "markov_rank": rank, "markov_head_type": "vanilla", "enable_confidence_head": conf,
            "confidence_head_with_markov": not conf or h.dims("conf_proj.weight")[0] == hidden + rank}


def _gemma4_rope(h: Header, head_dim: int) -> dict[str, Any]:
    """The full layers' rope_parameters: proportional where the file has `rope_freqs` (1 for each rotated pair,
    then 1e30: frequency 0), else default."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(h.get("rope.freq_base", 1_000_000.0))}
    if "rope_freqs.weight" not in h.tensors:
        return rope
    factors = h.f32("rope_freqs.weight")
    pairs = int((factors == 1.0).sum())
    if factors.shape != (head_dim // 2,) or not ((factors[:pairs] == 1.0).all() and (factors[pairs:] >= 1e29).all()):
        raise ValueError("this Gemma 4 DSpark GGUF has per-dimension RoPE frequencies (rope_freqs) other than "
                         "proportional RoPE's (1 for each rotated pair, then 1e30): not supported")
    return {**rope, "rope_type": "proportional", "partial_rotary_factor": 2 * pairs / head_dim}


def _dflash_config(h: Header) -> dict[str, Any]:
    """The config.json of the drafter's HF folder: DeepSpec's flat keys (`DSparkConfig.from_deepspec_json`) for
    Qwen3-style layers, the `Gemma4DSparkModel` layout (`gemma4_dspark.gemma4_dspark_json`) for Gemma 4 layers; but
    the target's depth, which the file does not hold (`dspark_checkpoint.read_dspark_config` takes the target's)."""
    _refuse(h, _UNSUPPORTED, "dspark's DSpark / DFlash networks do")
    if _gemma4_layers(h):
        _refuse(h, _GEMMA4_UNSUPPORTED, "dspark's Gemma 4 DSpark network does")
        return _gemma4_dflash_config(h)
    _refuse(h, _QWEN3_UNSUPPORTED, "dspark's DSpark / DFlash network (Qwen3-style draft layers) does")
    keys = _dspark_keys(h)
    heads, d2t = keys["num_attention_heads"], h.dims("d2t")[0] if "d2t" in h.tensors else None
    return {
        "architectures": ["DFlashDraftModel" if not keys["markov_rank"] else "Qwen3DSparkModel"], "model_type": "qwen3",
        **keys, "num_key_value_heads": int(h.get("attention.head_count_kv", heads)),
        "head_dim": int(h.get("attention.key_length", keys["hidden_size"] // heads)),
        "rope_theta": float(h.get("rope.freq_base", 10000.0)), "rope_scaling": _rope_scaling(h), "hidden_act": "silu",
        "slot_layout": "dspark" if h.get("sample_from_anchor", False) else "zlab",
        "draft_vocab_size": d2t, "d2t_format": "absolute",  # (vocab.D2T_FORMAT_KEY) as the converter writes it
    }


def _gemma4_dflash_config(h: Header) -> dict[str, Any]:
    """A `Gemma4DSparkModel` config.json (the full layers' head as `global_head_dim` with
    `num_global_key_value_heads`, K = V, the converter's fixed embedding and attention scales implied)."""
    keys, head_dim = _dspark_keys(h), int(h.get("attention.key_length"))
    kv = int(h.get("attention.head_count_kv", keys["num_attention_heads"]))
    return {
        "architectures": [GEMMA4_DSPARK], "model_type": "gemma4_dspark", **keys,
        "num_key_value_heads": kv, "global_head_dim": head_dim, "num_global_key_value_heads": kv,
        "attention_k_eq_v": True, "layer_types": ["full_attention"] * keys["num_hidden_layers"],
        "hidden_activation": _GELU_TANH, "tie_word_embeddings": "output.weight" not in h.tensors,
        "rope_parameters": {"full_attention": _gemma4_rope(h, head_dim)},
        "sample_from_anchor": bool(h.get("sample_from_anchor", True)),
    }


register_gguf_drafter("gemma4-assistant", GGUFDrafter("Gemma 4 assistant", ("mtp",), _assistant_config,
                                                      _assistant_name))
register_gguf_drafter("dflash", GGUFDrafter("DFlash / DSpark drafter", ("dspark", "dflash"), _dflash_config,
                                            _dflash_name))
