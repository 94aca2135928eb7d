"""dspark: a speculative-decoding inference engine built around DSpark.

Public API: `LLM`, `SamplingParams`, `EngineConfig`.
"""
from dspark.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name):  # lazy: importing dspark must not import torch-heavy engine modules eagerly
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from dspark import llm
        return getattr(llm, name)
    if name == "EngineConfig":
        from dspark.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
