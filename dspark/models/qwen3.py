"""Qwen3 target model: Llama plus a per-head RMSNorm over head_dim on q and k, applied before RoPE.

Everything else (fused projections, paged attention, taps, weight loading) is inherited from `llama.py`;
this file only swaps in an attention module with `q_norm` / `k_norm` (HF names
`self_attn.q_norm.weight`, `self_attn.k_norm.weight`).
"""

from __future__ import annotations

import torch

from dspark.models.config import ModelConfig
from dspark.models.family import ModelFamily
from dspark.models.layers import RMSNorm, apply_rope
from dspark.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(cfg, dtype=dtype, device=device)
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype, device=device)

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        q_size = self.num_heads * self.head_dim
        # contiguous: the fp32 CPU norm kernel then serves every batch shape alike
        q = self.q_norm(qkv[:, :q_size].contiguous().view(-1, self.num_heads, self.head_dim))  # [T, H, hd]
        k = self.k_norm(qkv[:, q_size:self.qk_size].contiguous().view(-1, self.num_kv_heads,
                                                                      self.head_dim))  # [T, Hkv, hd]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model


FAMILY = ModelFamily(architecture="Qwen3ForCausalLM", model_class=Qwen3ForCausalLM, model_types=("qwen3",),
                     qk_norm=True, gguf_names=("qwen3",), gguf_blocks=True)
