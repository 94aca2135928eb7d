"""dspark: a speculative-decoding inference engine built around DSpark.

Public API: `LLM`, `SamplingParams`, `EngineConfig`.
"""
from dspark.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig"]


def __getattr__(name):  # lazy: importing dspark must not import torch-heavy engine modules eagerly
    if name == "LLM":
        from dspark.llm import LLM
        return LLM
    if name == "EngineConfig":
        from dspark.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
