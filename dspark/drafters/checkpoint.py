"""Checkpoint I/O shared by the drafters: read a folder's config.json, read safetensors (one
`model.safetensors` or a sharded set with `model.safetensors.index.json`), check a tensor dict against a
module's expected keys and shapes (every mismatch names the key and both shapes), and write
safetensors.

A GGUF file (`*.gguf`, llama.cpp's converter) reads as the folder it was converted from: `read_config`,
`header_shapes`, `load_tensors` and `load_named` hand it to `gguf_drafters.py` (its config dict, its tensors under
HF names, dequantized), so every drafter loader reads a drafter GGUF as it reads a folder.

Only local folders and files are read; nothing is downloaded. Every file is read through `dspark.models.files`: a damaged
one (config.json not a JSON object, a truncated or garbage shard, an index entry leading out of the folder) is
a `CheckpointError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch

from dspark.models.files import (CheckpointError, folder_file, index_files, open_safetensors, read_json_object,
                                 safetensors_header)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_file(path: str | Path) -> Path:
    """The config.json of a checkpoint folder (or `path` itself, a file)."""
    path = Path(path)
    return folder_file(path, CONFIG_NAME) if path.is_dir() else path


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint folder (or the file itself; a GGUF file: its header's) as a dict."""
    if _is_gguf(path):
        from dspark.drafters.gguf_drafters import gguf_config
        return gguf_config(path)
    file = config_file(path)
    if not file.is_file():
        raise CheckpointError(f"drafter checkpoint {str(path)!r} has no {CONFIG_NAME}")
    return read_json_object(file)


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a folder: via the shard index, else model.safetensors, else *.safetensors."""
    path = Path(path)
    index = folder_file(path, INDEX_NAME)
    if index.is_file():
        return sorted(index_files(index))
    weights = folder_file(path, WEIGHTS_NAME)
    if weights.is_file():
        return [weights]
    files = [folder_file(path, f.name) for f in sorted(path.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(f"drafter checkpoint {str(path)!r} has no *.safetensors weights")
    return files


def load_tensors(path: str | Path, *, skip: Iterable[str] = (), device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder by name; names starting with a `skip` prefix are not read.
    Floating-point tensors are cast to `dtype` when given (integer buffers such as `d2t` never are). Each
    tensor owns its memory: safetensors' own are views of the mapped file, and one kept as read (the shipped
    SmolLM2 drafter's 64 KiB `d2t`) kept the whole file (33 MiB) mapped and resident. A GGUF file's are dequantized
    (fp32, then cast)."""
    if _is_gguf(path):
        from dspark.drafters.gguf_drafters import gguf_tensors
        return gguf_tensors(path, skip=skip, device=device, dtype=dtype)
    skip = tuple(skip)
    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with open_safetensors(file) as f:
            for name in f.keys():
                if skip and name.startswith(skip):
                    continue
                mapped = f.get_tensor(name)
                t = mapped.to(dtype) if dtype is not None and mapped.is_floating_point() else mapped
                t = t.to(device)
                out[name] = t.clone() if t.data_ptr() == mapped.data_ptr() else t
    return out


def load_named(path: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of those `names` it holds, read alone: no other tensor's data."""
    names = tuple(names)
    if _is_gguf(path):
        from dspark.drafters.gguf_drafters import gguf_tensors
        return gguf_tensors(path, only=names)
    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with open_safetensors(file) as f:
            for name in names:
                if name in f.keys():
                    out[name] = f.get_tensor(name).clone()
    return out


def header_shapes(path: str | Path) -> dict[str, list[int]]:
    """Every tensor's shape by name from the safetensors headers of a checkpoint folder (a GGUF file: its header,
    HF names and shapes); no data read."""
    if _is_gguf(path):
        from dspark.drafters.gguf_drafters import gguf_shapes
        return gguf_shapes(path)
    return {name: shape for name, (_, shape, _) in safetensors_header(safetensors_files(path)).items()}


def _is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"  # (gguf_drafters is imported only where a GGUF is read)


def check_shapes(expected: dict[str, Any], shapes: dict[str, Any], *, where: str,
                 optional: dict[str, Any] | None = None) -> None:
    """Exact key/shape match of `shapes` (name → shape) against `expected`; names in `optional` may be
    absent but, when present, must have that shape. Raises ValueError naming the first offending key and
    both shapes."""
    optional = optional or {}
    for name, shape in expected.items():
        if name not in shapes:
            raise ValueError(f"{where}: checkpoint lacks tensor {name!r} (expected shape {list(shape)})")
    for name, shape in {**expected, **optional}.items():
        if name in shapes and tuple(shapes[name]) != tuple(shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {list(shapes[name])}, "
                             f"the model expects {list(shape)}")
    unexpected = sorted(set(shapes) - set(expected) - set(optional))
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor {unexpected[0]!r} (shape "
                         f"{list(shapes[unexpected[0]])}); the model has no such parameter")


def check_tensors(expected: dict[str, torch.Size], tensors: dict[str, torch.Tensor], *,
                  where: str) -> None:
    """Exact key/shape match; raises ValueError naming the first offending key and both shapes."""
    check_shapes(expected, {k: t.shape for k, t in tensors.items()}, where=where)


def same_weights(own: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether a checkpoint's copy of a frozen target weight (embedding, LM head) holds the target's values,
    up to rounding to the checkpoint's dtype (a bf16 file of fp32 weights)."""
    if tuple(own.shape) != tuple(target.shape):
        return False
    eps = torch.finfo(own.dtype).eps if own.is_floating_point() else 0.0
    return bool(torch.allclose(own.float(), target.detach().to(own.device).float(), rtol=eps, atol=1e-6))


def save_tensors(tensors: dict[str, torch.Tensor], file: str | Path, *,
                 dtype: torch.dtype | None = None) -> None:
    """Write one safetensors file (contiguous CPU copies; float tensors cast to `dtype` if given)."""
    from safetensors.torch import save_file

    out = {}
    for name, t in tensors.items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to("cpu").contiguous().clone()
    save_file(out, str(file), metadata={"format": "pt"})


def save_weights(tensors: dict[str, torch.Tensor], folder: str | Path, *, dtype: torch.dtype | None = None,
                 max_shard_bytes: int | None = None) -> list[Path]:
    """`folder/model.safetensors`, or with `max_shard_bytes` as many `model-0000i-of-0000n.safetensors` shards
    as keep each file's tensors within that size plus `model.safetensors.index.json` (HF's sharded layout,
    which `safetensors_files` reads). A single tensor larger than the limit is an error. Returns the files."""
    folder = Path(folder)
    for old in [*folder.glob("model*.safetensors"), folder / INDEX_NAME]:
        old.unlink(missing_ok=True)  # a re-export with another layout leaves nothing stale behind
    if max_shard_bytes is None:
        save_tensors(tensors, folder / WEIGHTS_NAME, dtype=dtype)
        return [folder / WEIGHTS_NAME]

    def nbytes(t: torch.Tensor) -> int:  # its data plus a generous share of the file's JSON header
        size = torch.finfo(dtype).bits // 8 if dtype is not None and t.is_floating_point() else t.element_size()
        return t.numel() * size + 256

    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in tensors.items():
        n = nbytes(t)
        if n > max_shard_bytes:
            raise ValueError(f"tensor {name!r} ({n - 256} bytes) exceeds the shard limit of {max_shard_bytes} bytes")
        if used + n > max_shard_bytes and shards[-1]:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += n
    files, weight_map = [], {}
    for i, part in enumerate(shards):
        file = folder / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_tensors(part, file, dtype=dtype)
        files.append(file)
        weight_map.update({name: file.name for name in part})
    write_json({"metadata": {"total_size": sum(nbytes(t) - 256 for t in tensors.values())}, "weight_map": weight_map},
               folder / INDEX_NAME)
    return files


def write_json(obj: dict[str, Any], file: str | Path) -> None:
    Path(file).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
