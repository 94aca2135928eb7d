"""One record per speculative method (`DrafterMethod`) and the registry `SpecConfig` and `build_drafter` ask.

A record names the method, the module that checks and builds its drafter (`check(spec, target_config)`, may be
absent; `build(spec, *, target_config, target_model, dtype, device) -> Drafter`), and what the method needs and
accepts: a drafter checkpoint, a confidence head (adaptive length policies), a Markov head (`draft_topk`), a
reduced draft vocabulary, a bounded drafter context, prompt lookup. Adding a method is its module plus one
`register_method` line here (or, from outside the package, one call).

Imports nothing (no torch, nothing of dspark): `dspark.config` reads it (tests/test_import_graph.py places this
module in the configuration layer), and the package's `__init__` loads the drafter modules only when asked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterMethod:
    name: str  # the `method` of a speculative config
    module: str  # the module holding `build` (and `check`) of its drafter
    needs_checkpoint: bool = False  # "model" (the drafter checkpoint) is required
    own_checkpoint: bool = False  # "model" defaults to the target's own folder (its MTP layers live there)
    confidence_head: bool = False  # its drafts carry confidences: the adaptive length policies apply
    markov_head: bool = False  # it proposes through a Markov head: `draft_topk` applies
    draft_vocab: bool = False  # its head may score a reduced draft vocabulary: `draft_vocab_size` applies
    context_window: bool = False  # its drafter context may be bounded: `draft_context_window` applies
    prompt_lookup: bool = False  # it is prompt lookup itself: `lookup_corpus` applies, `ngram_first` does not
    runs_target_layers: bool = False  # it runs the target's own first layers (whole on every rank: no TP)


_METHODS: dict[str, DrafterMethod] = {}


def register_method(*methods: DrafterMethod) -> None:
    """Add records (a name taken by another record is refused; the same record again is a no-op)."""
    for m in methods:
        other = _METHODS.get(m.name)
        if other is not None and other != m:
            raise ValueError(f"speculative method {m.name!r} is already registered ({other.module})")
        _METHODS[m.name] = m


def unregister_method(name: str) -> None:
    """Drop a record (tests register toy methods and remove them again)."""
    _METHODS.pop(name, None)


def method_names() -> tuple[str, ...]:
    """The registered methods, in registration order."""
    return tuple(_METHODS)


def method_record(name: str) -> DrafterMethod | None:
    return _METHODS.get(name)


def methods_with(capability: str) -> tuple[str, ...]:
    """The methods whose record has `capability` set, in registration order."""
    return tuple(m.name for m in _METHODS.values() if getattr(m, capability))


def names_phrase(names: tuple[str, ...]) -> str:
    """"method 'a'" or "methods 'a', 'b' and 'c'" (for messages)."""
    quoted = [f"'{n}'" for n in names]
    if len(quoted) == 1:
        return f"method {quoted[0]}"
    return f"methods {', '.join(quoted[:-1])} and {quoted[-1]}"


# "dflash" is the DSpark drafter with its Markov and confidence heads off
register_method(DrafterMethod("dspark", "dspark.drafters.dspark", needs_checkpoint=True, confidence_head=True,
                              markov_head=True, draft_vocab=True, context_window=True))
register_method(DrafterMethod("dflash", "dspark.drafters.dspark", needs_checkpoint=True, draft_vocab=True,
                              context_window=True))
register_method(DrafterMethod("eagle3", "dspark.drafters.eagle3", needs_checkpoint=True, draft_vocab=True))
register_method(DrafterMethod("ngram", "dspark.drafters.ngram", prompt_lookup=True))
register_method(DrafterMethod("draft_model", "dspark.drafters.draft_model", runs_target_layers=True))
register_method(DrafterMethod("mtp", "dspark.drafters.mtp", own_checkpoint=True))
