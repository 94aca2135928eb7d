"""The files of a model or drafter folder, read so that a damaged one is refused by name.

Every refusal is a `CheckpointError` (a ValueError) whose message starts with the file it is about:

* `read_json_object`: a JSON file that must hold an object (config.json, generation_config.json,
  calibration.json, a safetensors index);
* `folder_file`: a name inside a folder, fixed or listed by an index, that stays inside it (no absolute path,
  no `..` escape, no symlink out of the folder; an HF hub snapshot's links into its repository's `blobs/`
  excepted) and is a regular file where it exists;
* `index_files`: the shards a `*.safetensors.index.json` weight_map names, each through `folder_file`;
* `open_safetensors`, `safetensors_header`: safetensors' own errors (a truncated or garbage file, a tensor past
  the end of the file, an unknown dtype) as errors naming the file;
* `config_error`: what parsing a config raised (`CONFIG_ERRORS`: a missing key, a wrong type) as an error
  naming its file;
* `check_sizes`, `check_num_layers`: a config's sizes are positive integers, and its layer count is no more
  than its weights hold, checked before any module is built.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

MAX_JSON_BYTES = 64 << 20  # a config or index is kilobytes; a larger "JSON" file is not one
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "num_target_layers", "block_size")
NESTED_CONFIGS = ("text_config", "transformer_layer_config")  # where multimodal / Speculators configs nest them
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # HF names: model.layers.<i>.…, layers.<i>.…
_JSON_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


class CheckpointError(ValueError):
    """A model or drafter folder's file that is missing, damaged or inconsistent; the message names the file."""


# what parsing a config dict of the wrong shape raises (a missing key, a string where a number goes, ...)
CONFIG_ERRORS = (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError)


def config_error(file: str | Path, e: Exception) -> CheckpointError:
    """`e`, raised while parsing the config read from `file`, as a `CheckpointError` naming the file."""
    if isinstance(e, CheckpointError):
        return e
    return CheckpointError(f"{file}: {f'lacks {e.args[0]!r}' if isinstance(e, KeyError) else e}")


def read_json_object(file: str | Path) -> dict[str, Any]:
    """The JSON object in `file`; anything else (not UTF-8, not JSON, a list, too large) is refused."""
    file = Path(file)
    try:
        size = file.stat().st_size
        if not file.is_file():
            raise CheckpointError(f"{file}: not a regular file")
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{file}: {size} bytes, more than any config or index holds")
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{file}: not valid JSON (not UTF-8 text)") from None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON (line {e.lineno} col {e.colno}: {e.msg})") from None
    except RecursionError:
        raise CheckpointError(f"{file}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {_JSON_KINDS.get(type(data), type(data).__name__)}")
    return data


def folder_file(folder: str | Path, name: Any, *, listed_in: str | Path | None = None) -> Path:
    """`folder / name`, refused unless it resolves inside `folder` (or, for an HF hub snapshot, inside its
    repository's `blobs/`) and, where it exists, is a regular file. `listed_in`: the index or config that named
    it, for the message."""
    where = f"{listed_in}: entry {name!r}" if listed_in is not None else f"{Path(folder) / str(name)}"
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{where} is not a file name")
    if Path(name).is_absolute():
        raise CheckpointError(f"{where} is an absolute path; only files inside {folder} are read")
    try:
        root = Path(folder).resolve()
        real = (root / name).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise CheckpointError(f"{where} cannot be resolved ({e})") from None
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if not (real.is_relative_to(root) or (blobs is not None and real.is_relative_to(blobs))):
        raise CheckpointError(f"{where} resolves to {real}, outside {root}; only files inside the folder are read")
    if real.exists() and not real.is_file():
        raise CheckpointError(f"{where} is not a regular file")
    return Path(folder) / name


def index_files(index: str | Path) -> list[Path]:
    """The distinct files the `weight_map` of a safetensors index names (first-seen order), each inside the
    index's folder and present."""
    index = Path(index)
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: weight_map must be a non-empty object of tensor name -> file name")
    files: dict[str, Path] = {}
    for tensor, name in weight_map.items():
        if isinstance(name, str) and name in files:
            continue
        file = folder_file(index.parent, name, listed_in=index)
        if not file.is_file():
            raise CheckpointError(f"{index}: entry {name!r} (tensor {tensor!r}): no such file in {index.parent}")
        files[name] = file
    return list(files.values())


@contextmanager
def open_safetensors(file: str | Path, *, framework: str = "pt") -> Iterator[Any]:
    """`safetensors.safe_open(file)` on the CPU, with safetensors' errors (at open: the header; inside the
    `with`: a tensor read) raised as a `CheckpointError` naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework=framework, device="cpu")
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror or e})") from None
    except SafetensorError as e:
        raise CheckpointError(f"{file}: damaged safetensors file ({_safetensors_reason(e)})") from None
    with handle as f:
        try:
            yield f
        except SafetensorError as e:
            raise CheckpointError(f"{file}: damaged safetensors file ({_safetensors_reason(e)})") from None


def safetensors_header(files: Iterable[str | Path]) -> dict[str, tuple[str, list[int], Path]]:
    """(dtype, shape, file) of every tensor in `files` by name, from their headers alone (no data read); a name
    held by two files is refused."""
    out: dict[str, tuple[str, list[int], Path]] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"{file}: tensor {name!r} is also in {out[name][2]}")
                part = f.get_slice(name)
                out[name] = (str(part.get_dtype()), [int(n) for n in part.get_shape()], Path(file))
    return out


def _safetensors_reason(e: Exception) -> str:
    text = str(e).removeprefix("Error while deserializing header: ")
    if "not fully covered" in text:
        return "truncated: its header describes more data than the file holds"
    if "header too large" in text or "header too small" in text:
        return f"no safetensors header: {text}"
    return text


def check_sizes(config: dict[str, Any], *, file: str | Path, keys: Iterable[str] = SIZE_KEYS) -> None:
    """Each size in `config` (and its nested text / layer config) that is given must be a positive integer
    (`intermediate_size` may be 0: a MoE model whose every layer routes to experts has no dense MLP)."""
    scopes = [config, *(config[k] for k in NESTED_CONFIGS if isinstance(config.get(k), dict))]
    for scope in scopes:
        for key in keys:
            value, least = scope.get(key), 0 if key == "intermediate_size" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                kind = "a non-negative" if least == 0 else "a positive"
                raise CheckpointError(f"{file}: {key} {value!r} is not {kind} integer")


def layers_held(names: Iterable[str], pattern: re.Pattern = LAYER_INDEX) -> int:
    """The layers a set of tensor names holds: the highest layer index + 1 (0 when none)."""
    return max((int(m.group(1)) + 1 for n in names if (m := pattern.search(n))), default=0)


def check_num_layers(num_layers: int, names: Iterable[str], *, file: str | Path, limit: int | None = None,
                     limit_what: str = "", key: str = "num_hidden_layers",
                     pattern: re.Pattern = LAYER_INDEX) -> None:
    """A config's layer count (`key` in `file`) against the layers its weights `names` hold and an optional
    `limit` (`limit_what` says whose); checked before any module is built, so an absurd count is refused in
    milliseconds, not after building that many layers."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise CheckpointError(f"{file}: {key} {num_layers!r} is not a positive integer")
    held = layers_held(names, pattern)
    if num_layers > held:
        raise CheckpointError(f"{file}: {key} {num_layers}, but its weights hold {held} layer{'s' * (held != 1)}")
    if limit is not None and num_layers > limit:
        raise CheckpointError(f"{file}: {key} {num_layers} exceeds {limit_what} {limit}")
