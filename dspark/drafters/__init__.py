"""Drafter registry: one `DrafterMethod` record per speculative method (`dspark.drafters.methods`), naming the
module with `check(spec, target_config)` (validates the drafter's configuration against the target before any
weight is loaded; may be absent) and `build(spec, *, target_config, target_model, dtype, device) -> Drafter`.

"dflash" is the DSpark drafter with the Markov and confidence heads switched off. A drafter GGUF file (llama.cpp's
converter) given as "model" reads as its HF folder (`gguf_drafters.py`); one given to a method that does not read it
is refused here, naming both, and `spec_schema` infers the method from it as from a folder's config.json. `"ngram_first": true`
wraps any of them in `LookupFirstDrafter` (prompt lookup first, the model where lookup cannot do better).

Importing this package loads no drafter and no torch: `dspark.config` reads the method records through it, so
`Drafter` and `DraftProposal` (`base.py`) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dspark.drafters.methods import DrafterMethod, method_names, method_record, register_method
from dspark.spec_schema import register_file_config

if TYPE_CHECKING:
    from dspark.config import SpecConfig
    from dspark.drafters.base import Drafter


def _module(method: str):
    record = method_record(method)
    if record is None:
        raise ValueError(f"unknown drafter {method!r}; registered: {', '.join(method_names())}")
    return importlib.import_module(record.module)


def _gguf_config(path: str) -> dict:
    return importlib.import_module("dspark.drafters.gguf_drafters").gguf_config(path)


register_file_config(".gguf", _gguf_config)  # the method of a drafter GGUF, inferred from its header


def _check_file(spec: SpecConfig) -> None:
    """A drafter GGUF given to a method that does not read it is refused by name."""
    if spec.model and str(spec.model).endswith(".gguf"):
        importlib.import_module("dspark.drafters.gguf_drafters").check_method(spec.model, spec.method)


def check_drafter(spec: SpecConfig, target_config) -> None:
    """Fail before loading weights when the drafter does not fit the target."""
    _check_file(spec)
    check = getattr(_module(spec.method), "check", None)
    if check is not None:
        check(spec, target_config)
    if spec.lookup_corpus:
        from dspark.drafters.corpus import check_corpus
        check_corpus(spec.lookup_corpus, vocab_size=target_config.vocab_size)


def build_drafter(spec: SpecConfig, *, target_config, target_model, dtype, device) -> Drafter:
    _check_file(spec)
    drafter = _module(spec.method).build(spec, target_config=target_config, target_model=target_model,
                                         dtype=dtype, device=device)
    if spec.ngram_first:
        from dspark.drafters.lookup_first import LookupFirstDrafter
        from dspark.drafters.ngram import load_corpus
        drafter = LookupFirstDrafter(drafter, prompt_lookup_min=spec.prompt_lookup_min,
                                     prompt_lookup_max=spec.prompt_lookup_max,
                                     lookup_cache_entries=spec.lookup_cache_entries,
                                     corpus=load_corpus(spec, target_config))
    return drafter


def __getattr__(name: str) -> Any:
    """`Drafter` and `DraftProposal` from `base.py`, imported on first use (it imports torch)."""
    if name in ("Drafter", "DraftProposal"):
        from dspark.drafters import base
        return getattr(base, name)
    raise AttributeError(f"module 'dspark.drafters' has no attribute {name!r}")


__all__ = ["DraftProposal", "Drafter", "DrafterMethod", "build_drafter", "check_drafter", "register_method"]
