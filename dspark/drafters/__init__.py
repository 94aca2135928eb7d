"""Drafter registry: method name → module with `check(spec, target_config)` (validates the drafter's
configuration against the target before any weight is loaded; may be absent) and
`build(spec, *, target_config, target_model, dtype, device) -> Drafter`.

"dflash" is the DSpark drafter with the Markov and confidence heads switched off. `"ngram_first": true`
wraps any of them in `LookupFirstDrafter` (prompt lookup first, the model where lookup cannot do better).
"""

from __future__ import annotations

import importlib

from dspark.config import SPEC_METHODS, SpecConfig
from dspark.drafters.base import DraftProposal, Drafter

DRAFTER_REGISTRY = SPEC_METHODS  # method -> module (one table: dspark.config)


def _module(method: str):
    if method not in DRAFTER_REGISTRY:
        raise ValueError(f"unknown drafter {method!r}; registered: {', '.join(DRAFTER_REGISTRY)}")
    return importlib.import_module(DRAFTER_REGISTRY[method])


def check_drafter(spec: SpecConfig, target_config) -> None:
    """Fail before loading weights when the drafter does not fit the target."""
    check = getattr(_module(spec.method), "check", None)
    if check is not None:
        check(spec, target_config)
    if spec.lookup_corpus:
        from dspark.drafters.corpus import check_corpus
        check_corpus(spec.lookup_corpus, vocab_size=target_config.vocab_size)


def build_drafter(spec: SpecConfig, *, target_config, target_model, dtype, device) -> Drafter:
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


__all__ = ["DRAFTER_REGISTRY", "DraftProposal", "Drafter", "build_drafter", "check_drafter"]
