"""Target-model families (Llama, Qwen3, Gemma 3, Gemma 4, Qwen3-MoE): `MODEL_REGISTRY` maps an HF architecture
name to its module class, and `build_model` instantiates one from a `ModelConfig` (weights uninitialised;
see `loader.load_model`)."""

from __future__ import annotations

import torch
from torch import nn

from dspark.models.config import QK_NORM_ARCHITECTURES, ModelConfig
from dspark.models.gemma3 import Gemma3ForCausalLM
from dspark.models.gemma4 import Gemma4ForCausalLM
from dspark.models.llama import LlamaForCausalLM
from dspark.models.qwen3 import Qwen3ForCausalLM
from dspark.models.qwen3_next import Qwen3NextForCausalLM
from dspark.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # hybrid linear-attention targets: one module, the layout read from the config
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,
}


def build_model(config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> nn.Module:
    """An eval-mode model of `config.architecture` with empty (unloaded) weights."""
    if config.architecture not in MODEL_REGISTRY:
        raise ValueError(f"no model registered for {config.architecture!r}; "
                         f"registered: {', '.join(MODEL_REGISTRY)}")
    if config.qk_norm != (config.architecture in QK_NORM_ARCHITECTURES):
        raise ValueError(f"qk_norm={config.qk_norm} does not match architecture {config.architecture!r}")
    return MODEL_REGISTRY[config.architecture](config, dtype=dtype, device=device).eval()


__all__ = ["MODEL_REGISTRY", "ModelConfig", "build_model"]
