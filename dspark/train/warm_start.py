"""Warm start of a block drafter (DSpark / DFlash) from the target itself (`TrainConfig.warm_start
"target"`), instead of N(0, init_std) projections.

What is copied, and why:

* **Draft layer i ← target layer `warm_start_layers[i]`**, by default the target's *last* n layers
  (SmolLM2-135M, 30 layers, 2 draft layers: 28 and 29). The draft layers have the target's per-layer
  geometry, and the drafter's output goes through the target's final norm (copied, `copy_final_norm`) and its
  frozen LM head: the last layers are the ones whose output lives in that head's input space and whose
  attention reads the context to pick the next token. The first layers would match only the block rows'
  input (token embeddings) and leave the drafter to learn the whole way up to the head.
* **fc ← the identity on the deepest tap** (zero on the others; SmolLM2: tap 25), and **hidden_norm ← the first
  warm layer's input_layernorm**: the context K/V of draft layer 0 are then k/v_proj(input_layernorm(h_25)),
  what target layer 28 computes from its own input h_27, a few residual updates later in the same stream. The
  other taps start at zero and are learnt.
* q_norm / k_norm are the target's where it has them (Qwen3), else 1; the Markov and confidence heads keep
  their random start (the target has no such parameters).

`warm_start_from_target` returns the names copied (the tests check them equal to the target's at step 0).
"""

from __future__ import annotations

import torch

WARM_STARTS = ("none", "target")


def default_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The target's last `num_draft_layers` layers."""
    if num_draft_layers > num_target_layers:
        raise ValueError(f"warm start: {num_draft_layers} draft layers but the target has {num_target_layers}")
    return tuple(range(num_target_layers - num_draft_layers, num_target_layers))


def target_layer_weights(layer) -> dict[str, torch.Tensor]:
    """One dspark.models decoder layer's weights under the drafter layer's (unfused, HF) names."""
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: four (1 + w) norms, GELU; the drafter has neither
        raise ValueError(f"warm start: the target's layers ({type(layer).__name__}) are not the drafter's "
                         "(pre/post-norm Llama layers); train this target's drafter with warm_start \"none\"")
    attn, mlp = layer.self_attn, layer.mlp
    out = {"input_layernorm.weight": layer.input_layernorm.weight,
           "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
           "self_attn.o_proj.weight": attn.o_proj.weight, "mlp.down_proj.weight": mlp.down_proj.weight}
    for merged, names in ((attn.qkv_proj, {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj"}),
                          (mlp.gate_up_proj, {"gate": "mlp.gate_proj", "up": "mlp.up_proj"})):
        if getattr(merged, "bias", None) is not None:
            raise ValueError("warm start: target projections with biases have no drafter counterpart")
        for shard, (start, rows) in merged.shard_rows.items():
            out[f"{names[shard]}.weight"] = merged.weight.narrow(0, start, rows)
    for name in ("q_norm", "k_norm"):
        if hasattr(attn, name):
            out[f"self_attn.{name}.weight"] = getattr(attn, name).weight
    return out


@torch.no_grad()
def warm_start_from_target(model, target, *, layer_ids: tuple[int, ...] | None = None) -> list[str]:
    """Copy target layers into the drafter's layers, fc ← identity on the deepest tap, hidden_norm ← the
    first copied layer's input norm. Returns the drafter parameter names set from the target."""
    cfg = model.cfg
    layers = target.model.layers
    layer_ids = default_layers(len(layers), cfg.num_hidden_layers) if layer_ids is None else tuple(layer_ids)
    if len(layer_ids) != cfg.num_hidden_layers:
        raise ValueError(f"warm_start_layers {list(layer_ids)} name {len(layer_ids)} layers; the drafter has "
                         f"{cfg.num_hidden_layers}")
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"warm_start_layers {bad} outside the target's {len(layers)} layers")
    params = dict(model.named_parameters())
    copied = []
    for i, tid in enumerate(layer_ids):
        for name, w in target_layer_weights(layers[tid]).items():
            mine = params[f"layers.{i}.{name}"]
            if tuple(mine.shape) != tuple(w.shape):
                raise ValueError(f"warm start: target layer {tid} {name} has shape {list(w.shape)}, the drafter "
                                 f"{list(mine.shape)}")
            mine.copy_(w.to(mine.dtype))
            copied.append(f"layers.{i}.{name}")
    d = cfg.hidden_size
    deepest = max(range(cfg.num_taps), key=lambda j: cfg.tap_layer_ids[j])
    model.fc.weight.zero_()
    model.fc.weight[:, deepest * d:(deepest + 1) * d] = torch.eye(d, dtype=model.fc.weight.dtype)
    model.hidden_norm.weight.copy_(layers[layer_ids[0]].input_layernorm.weight.to(model.hidden_norm.weight.dtype))
    return copied + ["hidden_norm.weight"]
