"""Sampling defaults from a model's `generation_config.json` (vLLM's `--generation-config`): the values a
request leaves unset come from the file, as transformers' `generate` would use them.

    auto   the model folder's generation_config.json, when it has one (a GGUF file has none)
    vllm   none: dspark's (OpenAI's) own defaults
    PATH   a folder holding generation_config.json, or the file itself (must exist)

Keys read: temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty and
max_new_tokens (→ max_tokens); only those `SamplingParams` has are used.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path

log = logging.getLogger(__name__)
FILE = "generation_config.json"
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
        "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def _file(setting: str, model: str) -> Path | None:
    if setting == "vllm":
        return None
    if setting == "auto":
        path = Path(model) / FILE
        return path if Path(model).is_dir() and path.is_file() else None
    path = Path(setting)
    path = path / FILE if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"generation_config {setting!r}: no {FILE} there")
    return path


def sampling_defaults(setting: str, model: str) -> dict:
    """SamplingParams keyword arguments from the generation config `setting` of `model`."""
    path = _file(setting, model)
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    from dspark.sampling import SamplingParams
    known = {f.name for f in fields(SamplingParams)}
    out = {ours: data[theirs] for theirs, ours in KEYS.items() if theirs in data and ours in known
           and data[theirs] is not None}
    if out:
        log.info("sampling defaults from %s: %s", path, out)
    return out


def apply_defaults(params, req, defaults: dict):
    """`params` (built from request `req`) with `defaults` for the fields `req` left unset (None or absent);
    max_tokens counts as set when `max_tokens` or `max_completion_tokens` is."""
    if not defaults:
        return params
    import dataclasses
    unset = {k: v for k, v in defaults.items() if getattr(req, k, None) is None}
    if "max_tokens" in unset and getattr(req, "max_completion_tokens", None) is not None:
        del unset["max_tokens"]
    return dataclasses.replace(params, **unset) if unset else params
