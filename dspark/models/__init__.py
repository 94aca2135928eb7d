"""Target-model families and their registry: each family module declares one `ModelFamily` record
(`dspark.models.family`) and the `register_family` line below adds it, in the order error messages list the
supported architectures; `build_model` instantiates a family's module class from a `ModelConfig` (weights
uninitialised; see `loader.load_model`)."""

from __future__ import annotations

import torch
from torch import nn

from dspark.models import gemma3, gemma4, llama, qwen3, qwen3_moe, qwen3_next
from dspark.models.config import ModelConfig
from dspark.models.family import ModelFamily, families, family_of, register_family

register_family(llama.FAMILY)
register_family(qwen3.FAMILY)
register_family(gemma3.FAMILY)
register_family(qwen3_moe.FAMILY)
register_family(*qwen3_next.FAMILIES)  # Qwen3-Next, Qwen3.5, Qwen3.5-MoE: one module class
register_family(gemma4.FAMILY)


def build_model(config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> nn.Module:
    """An eval-mode model of `config.architecture` with empty (unloaded) weights."""
    family = family_of(config.architecture)
    if family is None or family.architecture != config.architecture:
        raise ValueError(f"no model registered for {config.architecture!r}; "
                         f"registered: {', '.join(f.architecture for f in families())}")
    if config.qk_norm != family.qk_norm:
        raise ValueError(f"qk_norm={config.qk_norm} does not match architecture {config.architecture!r}")
    return family.model_class(config, dtype=dtype, device=device).eval()


__all__ = ["ModelConfig", "ModelFamily", "build_model", "family_of", "register_family"]
