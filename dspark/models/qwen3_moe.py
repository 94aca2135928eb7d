"""Qwen3-MoE target model (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3 whose MoE layers
(`ModelConfig.is_moe_layer`: every `decoder_sparse_step`-th layer not in `mlp_only_layers`) hold a sparse
mixture-of-experts block (`moe.SparseMoeBlock`, HF names `mlp.gate.weight`, `mlp.experts.E.{gate,up,down}_proj
.weight`); the other layers keep Qwen3's dense MLP of `intermediate_size`.

Attention, taps and the paged KV pool are Qwen3's. The one-call CPU decoder stack multiplies dense MLPs only, so
every step runs the per-layer modules (`LlamaForCausalLM.moe_layers`); tensor parallelism refuses the model
(`distributed.shard.check_shardable`). Its record (`FAMILY`) reads config.json as Qwen3's plus the MoE fields
(`moe_fields`, also read by the hybrid Qwen3-Next).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dspark.models.config import ModelConfig, llama_style_config, llama_style_hf
from dspark.models.family import ModelFamily
from dspark.models.moe import MoeWeights, SparseMoeBlock
from dspark.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, cfg: ModelConfig, layer_id: int, *, dtype: torch.dtype,
                  device: torch.device | str) -> nn.Module:
        if cfg.is_moe_layer(layer_id):
            return SparseMoeBlock(cfg, dtype=dtype, device=device)
        return super().build_mlp(cfg, layer_id, dtype=dtype, device=device)


class Qwen3MoeModel(Qwen3Model):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoeWeights, Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
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


def moe_to_hf(c: ModelConfig) -> dict[str, Any]:
    return {"model_type": "qwen3_moe", "num_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size, "norm_topk_prob": c.norm_topk_prob,
            "decoder_sparse_step": c.decoder_sparse_step, "mlp_only_layers": list(c.mlp_only_layers),
            "use_sliding_window": False}


FAMILY = ModelFamily(
    architecture="Qwen3MoeForCausalLM", model_class=Qwen3MoeForCausalLM, model_types=("qwen3_moe",),
    from_hf=lambda hf: llama_style_config(hf, "Qwen3MoeForCausalLM", qk_norm=True, **moe_fields(hf)),
    to_hf=lambda c: {**llama_style_hf(c, "qwen3_moe"), **moe_to_hf(c)}, qk_norm=True)
