"""Qwen3-MoE target model (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3 whose MoE layers
(`ModelConfig.is_moe_layer`: every `decoder_sparse_step`-th layer not in `mlp_only_layers`) hold a sparse
mixture-of-experts block (`moe.SparseMoeBlock`, HF names `mlp.gate.weight`, `mlp.experts.E.{gate,up,down}_proj
.weight`); the other layers keep Qwen3's dense MLP of `intermediate_size`.

Attention, taps and the paged KV pool are Qwen3's. The one-call CPU decoder stack multiplies dense MLPs only, so
every step runs the per-layer modules (`LlamaForCausalLM.moe_layers`); tensor parallelism refuses the model
(`distributed.shard.check_shardable`).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.models.config import ModelConfig
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
