"""Published drafter checkpoint formats, read into ours: config.json dicts translated to the keys
`DSparkConfig.from_deepspec_json` / `Eagle3Config.from_dict` take, and tensor dicts to our names.

Formats (facts from each project's published config classes and checkpoints, no code of theirs):

* **DeepSpec DSpark / DFlash** (`Qwen3DSparkModel`): our own DSpark format already (flat keys,
  `target_layer_ids` = decoder-layer outputs, stored `embed_tokens` / `lm_head` of the full vocabulary).
* **DeepSpec EAGLE-3** (`Qwen3Eagle3Model`): flat HF keys plus `target_layer_ids` (decoder-layer outputs,
  as ours), `num_target_layers`, `ttt_length` (the TTT unroll), `draft_num_hidden_layers` (1),
  `step_loss_decay` and `target_model_name_or_path` (training only); tensors ours plus `embed_tokens.weight`
  and a full-vocabulary `lm_head.weight`.
* **vLLM Speculators** (`speculators_model_type` "dspark", "dflash" or "eagle3"): the decoder geometry
  nested in `transformer_layer_config`; `aux_hidden_state_layer_ids` (DFlash, DSpark) or
  `eagle_aux_hidden_state_layer_ids` (EAGLE-3) count hidden states with 0 = the embedding output, so
  our tap id is theirs − 1; `draft_vocab_size`; `block_size` and `sample_from_anchor` (true: every slot
  predicts the next position, our "dspark" layout; false: the anchor is the bonus token and the masks
  predict their own positions, our "zlab" layout; DSpark defaults to true, DFlash to false);
  `mask_token_id`; the DSpark head keys (`markov_rank`, `markov_head_type`, `enable_confidence_head`,
  `confidence_head_with_markov`); EAGLE-3's `norm_before_residual`. The target's depth is not in the
  file: the target's own is used. Tensors carry our names plus `embed_tokens.weight`, a reduced-vocab
  `lm_head.weight` [draft_vocab, d], `d2t` as *offsets* (target id = draft id + d2t[draft id]) and `t2d`
  (a boolean mask over the target vocabulary), read into our in-memory absolute `d2t` by `vocab.read_d2t`
  (the offset convention, which every checkpoint of ours stores too, with `"d2t_format": "offset"`).
* **GGUF** (llama.cpp's converter, `general.architecture` dflash / gemma4-assistant): read by
  `gguf_drafters.py` into the config dict of the drafter's HF folder, marked with `GGUF_KEY`; like Speculators',
  a dflash file does not hold its target's depth.
"""

from __future__ import annotations

from typing import Any

import torch

SPECULATORS_KEY = "speculators_model_type"
GGUF_KEY = "gguf_architecture"  # the config dict `gguf_drafters.gguf_config` reads from a GGUF header
SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")
DEEPSPEC_EAGLE3_ARCH = "Qwen3Eagle3Model"
# tensors a Speculators checkpoint may carry that no drafter of ours reads
_SPECULATORS_DROPPED = ("verifier_norm.weight", "verifier_lm_head.weight")


def checkpoint_format(d: dict[str, Any]) -> str:
    """"speculators-<type>", "gguf-<architecture>", "deepspec-eagle3" or "native" (ours and DeepSpec's
    DSpark/DFlash)."""
    if SPECULATORS_KEY in d:
        return f"speculators-{d[SPECULATORS_KEY]}"
    if GGUF_KEY in d:
        return f"gguf-{d[GGUF_KEY]}"
    if DEEPSPEC_EAGLE3_ARCH in (d.get("architectures") or []) or "ttt_length" in d:
        return "deepspec-eagle3"
    return "native"


def names_target_depth(fmt: str) -> bool:
    """Whether a checkpoint of format `fmt` says how deep its target is (Speculators' and GGUF files do not: the
    target's own depth is used)."""
    return not fmt.startswith(("speculators-", "gguf-"))


def _layer_config(d: dict[str, Any]) -> dict[str, Any]:
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("Speculators config.json lacks the transformer_layer_config object")
    target_hidden = d.get("target_hidden_size")
    if target_hidden not in (None, layer.get("hidden_size")):
        raise ValueError(f"Speculators drafter with target_hidden_size {target_hidden} != its hidden_size "
                         f"{layer.get('hidden_size')}: a projection between the two is not supported")
    return layer


def _taps(ids, key: str) -> list[int]:
    if not ids:
        raise ValueError(f"Speculators config.json lacks {key} (the target layers it reads)")
    return [int(i) - 1 for i in ids]  # theirs count the embedding output as 0


def _rope(layer: dict[str, Any]) -> dict[str, Any]:
    out = {k: layer[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if layer.get(k) is not None}
    return out


def speculators_dspark_json(d: dict[str, Any], *, num_target_layers: int) -> dict[str, Any]:
    """A Speculators DSpark / DFlash config.json → the DeepSpec-style dict `DSparkConfig.from_deepspec_json`
    reads."""
    kind = d[SPECULATORS_KEY]
    if kind not in ("dspark", "dflash"):
        raise ValueError(f"Speculators drafter type {kind!r} is not a DSpark / DFlash block drafter")
    layer = _layer_config(d)
    if d.get("projector_type", "dflash") != "dflash":
        raise ValueError(f"Speculators DFlash projector_type {d['projector_type']!r} unsupported (only 'dflash')")
    bad = [t for t in layer.get("layer_types") or [] if t != "full_attention"]
    if bad:
        raise ValueError(f"Speculators drafter layer type {bad[0]!r} unsupported (only full_attention)")
    vocab = layer.get("vocab_size")
    draft_vocab = d.get("draft_vocab_size")
    out = {k: layer[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                                 "max_position_embeddings", "hidden_act", "attention_bias") if k in layer}
    out.update(_rope(layer))
    markov_rank = int(d.get("markov_rank") or 0) if kind == "dspark" else 0
    out.update(
        num_target_layers=num_target_layers, block_size=d.get("block_size"), mask_token_id=d.get("mask_token_id"),
        target_layer_ids=_taps(d.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids"),
        markov_rank=markov_rank, markov_head_type=d.get("markov_head_type") or "vanilla",
        enable_confidence_head=bool(d.get("enable_confidence_head")) and kind == "dspark",
        # (without a confidence head the flag means nothing: DSparkConfig's default then)
        confidence_head_with_markov=bool(d.get("confidence_head_with_markov", False)) if kind == "dspark" else True,
        slot_layout="dspark" if d.get("sample_from_anchor", kind == "dspark") else "zlab",
        draft_vocab_size=None if draft_vocab in (None, vocab) else int(draft_vocab))
    return out


def speculators_eagle3_dict(d: dict[str, Any], *, num_target_layers: int) -> dict[str, Any]:
    """A Speculators EAGLE-3 config.json → `Eagle3Config.from_dict` keys."""
    layer = _layer_config(d)
    for key in ("norm_before_fc", "fc_norm"):
        if d.get(key):
            raise ValueError(f"Speculators EAGLE-3 option {key}=true unsupported")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE-3 has one draft layer; the Speculators checkpoint has "
                         f"{layer['num_hidden_layers']}")
    proposals = (d.get("speculators_config") or {}).get("proposal_methods") or [{}]
    out = _eagle3_geometry(layer)
    out.update(
        tap_layer_ids=_taps(d.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"),
        target_num_hidden_layers=num_target_layers,
        num_draft_tokens=int(proposals[0].get("speculative_tokens") or 7),
        qk_norm=layer.get("model_type") == "qwen3",
        norm_before_residual=bool(d.get("norm_before_residual", False)))
    draft_vocab = d.get("draft_vocab_size")
    if draft_vocab not in (None, out["vocab_size"]):
        out["draft_vocab_size"] = int(draft_vocab)
    return out


def deepspec_eagle3_dict(d: dict[str, Any]) -> dict[str, Any]:
    """A DeepSpec EAGLE-3 config.json → `Eagle3Config.from_dict` keys."""
    layers = d.get("draft_num_hidden_layers", d.get("num_hidden_layers", 1))
    if int(layers) != 1:
        raise ValueError(f"EAGLE-3 has one draft layer; the DeepSpec checkpoint has {layers}")
    for key in ("target_layer_ids", "num_target_layers"):
        if d.get(key) is None:
            raise ValueError(f"DeepSpec EAGLE-3 config.json lacks {key!r}")
    out = _eagle3_geometry(d)
    out.update(tap_layer_ids=list(d["target_layer_ids"]), target_num_hidden_layers=int(d["num_target_layers"]),
               num_draft_tokens=int(d.get("ttt_length", 7)),
               qk_norm=d.get("model_type", "qwen3") == "qwen3" or DEEPSPEC_EAGLE3_ARCH in (d.get("architectures") or []))
    return out


def _eagle3_geometry(c: dict[str, Any]) -> dict[str, Any]:
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} unsupported (EAGLE-3 layers use silu)")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in c]
    if missing:
        raise ValueError(f"EAGLE-3 config.json lacks {missing[0]!r}")
    heads = int(c["num_attention_heads"])
    theta, scaling = c.get("rope_theta"), c.get("rope_scaling")
    params = c.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    out = dict(hidden_size=int(c["hidden_size"]), intermediate_size=int(c["intermediate_size"]),
               num_attention_heads=heads, num_key_value_heads=int(c.get("num_key_value_heads") or heads),
               head_dim=int(c.get("head_dim") or c["hidden_size"] // heads), vocab_size=int(c["vocab_size"]),
               rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
               rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=scaling,
               max_position_embeddings=int(c.get("max_position_embeddings", 8192)),
               attention_bias=bool(c.get("attention_bias", False)))
    return out


def speculators_tensors(tensors: dict[str, torch.Tensor], *, where: str) -> dict[str, torch.Tensor]:
    """Speculators tensor names → ours: the vocabulary maps (`d2t` offsets, `t2d`; read and checked by
    `vocab.read_d2t`) and the verifier's copies dropped."""
    del where
    return {k: v for k, v in tensors.items() if k not in _SPECULATORS_DROPPED and k not in ("d2t", "t2d")}


def header_shapes_speculators(shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """The header view of `speculators_tensors` (names and shapes only): a d2t as long as t2d (the whole
    vocabulary) is dropped there too."""
    out = {k: v for k, v in shapes.items() if k not in _SPECULATORS_DROPPED and k != "t2d"}
    if "d2t" in out and "t2d" in shapes and out["d2t"] == shapes["t2d"]:
        out.pop("d2t")
    return out


def eagle3_config_dict(d: dict[str, Any], *, num_target_layers: int | None, where: str) -> dict[str, Any]:
    """Any EAGLE-3 config.json (ours, DeepSpec's, Speculators') → `Eagle3Config.from_dict` keys."""
    fmt = checkpoint_format(d)
    if fmt == "deepspec-eagle3":
        return deepspec_eagle3_dict(d)
    if fmt == "speculators-eagle3":
        if num_target_layers is None:
            raise ValueError(f"EAGLE-3 checkpoint {where!r} (Speculators) does not name the target's depth; "
                             "load it against a target")
        return speculators_eagle3_dict(d, num_target_layers=num_target_layers)
    if fmt.startswith("speculators-"):
        raise ValueError(f"checkpoint {where!r} is a Speculators {d[SPECULATORS_KEY]!r} drafter, not EAGLE-3: "
                         f"use method {d[SPECULATORS_KEY]!r}")
    if "target_layer_ids" in d and "tap_layer_ids" not in d:
        raise ValueError(f"checkpoint {where!r} looks like a DSpark / DFlash block drafter (target_layer_ids, no "
                         "ttt_length): use method 'dspark' or 'dflash'")
    return {k: v for k, v in d.items() if k != "d2t_format"}  # how d2t is stored: `vocab.decode_d2t` reads it


def eagle3_tensors(d: dict[str, Any], tensors: dict[str, torch.Tensor], *, where: str) -> dict[str, torch.Tensor]:
    """An EAGLE-3 checkpoint's tensors under our names (Speculators' verifier copies and maps dropped)."""
    if checkpoint_format(d).startswith("speculators-"):
        return speculators_tensors(tensors, where=where)
    return tensors
