"""One record per model family (`ModelFamily`) and the registry the rest of the package asks.

A family module (`llama.py`, `qwen3.py`, `gemma3.py`, ...) declares its record next to its model class: the
architecture name `ModelConfig.architecture` holds, the HF names a config.json may give (`architectures`,
`model_type`), how its config.json is read and written, the GGUF `general.architecture` names of its llama.cpp
files and the capabilities callers branch on (q/k norm, recurrent state, q/k rows permuted in GGUF, tensor
parallelism, MTP). `dspark/models/__init__.py` registers the records, one line each, in the order error
messages list them. Callers ask `family_of(architecture)` for a capability instead of comparing names.

Imports nothing of dspark: `config.py` reads the registry while the family modules import `config.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # the served text decoder's HF architecture (`ModelConfig.architecture`)
    model_class: type  # the nn.Module `build_model` instantiates from a ModelConfig
    model_types: tuple[str, ...]  # HF model_type values read as this family; the first is the one written
    hf_architectures: tuple[str, ...] = ()  # further HF architectures served by it (a multimodal folder's)
    # config.json dict -> ModelConfig; None: Llama's field names (`config.llama_style_config`)
    from_hf: Callable[[dict[str, Any]], Any] | None = None
    # ModelConfig -> config.json dict; None: Llama's field names with model_types[0]
    to_hf: Callable[[Any], dict[str, Any]] | None = None
    qk_norm: bool = False  # per-head RMSNorm on q and k
    recurrent_state: bool = False  # hybrid: linear-attention layers with per-request recurrent state slots
    mtp: str = ""  # how method "mtp" drafts: "layers" (the checkpoint's own mtp.* layers), "assistant"; "": none
    no_tensor_parallel: str = ""  # why tensor parallelism cannot split it ("": it can)
    no_layer_view: str = ""  # why its first layers cannot draft as a view of it (draft_num_layers; "": they can)
    # llama.cpp GGUF files
    gguf_names: tuple[str, ...] = ()  # their `general.architecture` values
    gguf: Any = None  # a `gguf_families.GGUFFamily` (header, names, transforms by record); None: Llama's reader
    gguf_qk_permuted: bool = False  # the converter interleaves q/k rows per head (llama.cpp does so for Llama)
    gguf_norm_offset: bool = False  # RMSNorm weights are stored as 1 + weight
    gguf_blocks: bool = False  # the layer matrices may stay resident as GGUF blocks (`--matmul-dtype gguf`)
    gguf_tensor_names: dict[str, str] | None = None  # block leaf -> HF name (None: Llama's)
    gguf_fields: Callable[..., dict[str, Any]] | None = None  # (get, hidden, heads, layers) -> extra fields

    @property
    def names(self) -> tuple[str, ...]:
        """Every HF architecture name this family reads."""
        return (self.architecture, *self.hf_architectures)


_FAMILIES: dict[str, ModelFamily] = {}  # served architecture -> record, in registration order


def register_family(*families: ModelFamily) -> None:
    """Add records (a name already taken by another record is refused; registering the same record again is
    a no-op)."""
    for fam in families:
        for other in _FAMILIES.values():
            clash = (set(fam.names) & set(other.names)) | (set(fam.model_types) & set(other.model_types)) | \
                (set(fam.gguf_names) & set(other.gguf_names))
            if clash and other is not fam:
                raise ValueError(f"model family {fam.architecture!r}: {sorted(clash)} already belong to "
                                 f"{other.architecture!r}")
        _FAMILIES[fam.architecture] = fam


def unregister_family(architecture: str) -> None:
    """Drop a record (tests register toy families and remove them again)."""
    _FAMILIES.pop(architecture, None)


def families() -> tuple[ModelFamily, ...]:
    return tuple(_FAMILIES.values())


def served_architectures() -> tuple[str, ...]:
    """The `ModelConfig.architecture` values, in registration order."""
    return tuple(_FAMILIES)


def family_of(architecture: str) -> ModelFamily | None:
    """The record serving `architecture` (its own name or one of its `hf_architectures`); None when none."""
    fam = _FAMILIES.get(architecture)
    if fam is None:
        fam = next((f for f in _FAMILIES.values() if architecture in f.hf_architectures), None)
    return fam


def family_for_model_type(model_type: str | None) -> ModelFamily | None:
    return next((f for f in _FAMILIES.values() if model_type in f.model_types), None)


def family_for_gguf(name: str | None) -> ModelFamily | None:
    """The record of GGUF `general.architecture` `name`; None when none."""
    return next((f for f in _FAMILIES.values() if name in f.gguf_names), None)


def gguf_names() -> tuple[str, ...]:
    """Every supported GGUF `general.architecture`: those Llama's header reader reads in registration order,
    then the record-driven ones (`gguf` set) by name."""
    fams = families()
    return (*(n for f in fams if f.gguf is None for n in f.gguf_names),
            *sorted(n for f in fams if f.gguf is not None for n in f.gguf_names))


def architectures_with(capability: str, value: Any = None) -> tuple[str, ...]:
    """The served architectures whose record has `capability` set (equal to `value` where one is given), for
    messages that list them."""
    return tuple(f.architecture for f in _FAMILIES.values()
                 if (getattr(f, capability) == value if value is not None else getattr(f, capability)))
