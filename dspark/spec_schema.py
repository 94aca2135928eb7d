"""vLLM's `--speculative-config` as dspark reads it: the keys vLLM users write mapped onto `SpecConfig`,
and what vLLM infers filled in the same way.

- `method` omitted: inferred from the drafter's config.json (`train_config.json`'s method when the folder
  has one; DSpark-format blocks with a Markov or confidence head: dspark, without: dflash; EAGLE-3
  heads: eagle3; Gemma 4's assistant (model_type gemma4_assistant): mtp; a full causal LM: draft_model). A drafter
  file that is not a folder (a GGUF) is read by the reader registered for its suffix (`register_file_config`: the
  drafters package registers `gguf_drafters.gguf_config`, the config dict of the folder it was converted from).
  `"[ngram]"` is `ngram`; `"gemma4_assistant"`, `"qwen3_next_mtp"` and `"qwen3_5_mtp"` are `mtp`.
- `num_speculative_tokens` omitted: the drafter's block (drafts one block yields; EAGLE-3's
  `num_draft_tokens`).
- n-gram (`method: ngram`): vLLM's `prompt_lookup_min` / `prompt_lookup_max` defaults (both 5; one given:
  the other equals it).
- vLLM-side keys: `enable_adaptive_verification` (true: the prefix policy, Algorithm 1; false: fixed),
  `dspark_draft_topk` (`draft_topk`: the Markov head corrects only each position's K best candidates; "off": 0),
  `draft_tensor_parallel_size` (1); `rejection_sample_method` is `SpecConfig`'s own key ("standard" token by
  token, "block": block verification).

Unknown keys are refused by `SpecConfig.from_dict`, listing every key it knows (these included).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

VLLM_NGRAM_LOOKUP = 5  # vLLM's prompt_lookup_min / max when neither is given


def _adaptive(value: Any, d: dict) -> dict:
    if not isinstance(value, bool):
        raise ValueError(f"enable_adaptive_verification must be true or false, got {value!r}")
    return {"length_policy": "prefix" if value else "fixed"}


def _draft_topk(value: Any, d: dict) -> dict:
    if value in (None, "off", False, 0):
        return {"draft_topk": 0}
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"dspark_draft_topk must be \"off\" or a positive number of candidates, got {value!r}")
    return {"draft_topk": value}


def _draft_tp(value: Any, d: dict) -> dict:
    if value != 1:
        raise ValueError(f"draft_tensor_parallel_size={value!r}: the drafter runs on one rank; use 1")
    return {}


# vLLM key → f(value, whole dict) → SpecConfig keys it sets
VLLM_KEYS: dict[str, Callable[[Any, dict], dict]] = {
    "enable_adaptive_verification": _adaptive,
    "dspark_draft_topk": _draft_topk,
    "draft_tensor_parallel_size": _draft_tp,
}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


# file suffix -> reader of a drafter file's config dict (as a folder's config.json holds it)
FILE_CONFIGS: dict[str, Callable[[str], dict]] = {}


def register_file_config(suffix: str, reader: Callable[[str], dict]) -> None:
    FILE_CONFIGS[suffix] = reader


def infer_drafter(model: str) -> tuple[str, int | None]:
    """(method, drafts per block or None) of a drafter folder, from its config files, or of a drafter file, from
    the config its suffix's reader gives."""
    folder = Path(model)
    reader = FILE_CONFIGS.get(folder.suffix) if folder.is_file() else None
    cfg = _read_json(folder / "config.json") if folder.is_dir() else reader(model) if reader else {}
    if not cfg:
        raise ValueError(f"cannot infer the speculative method: {model!r} is not a folder with a config.json "
                         f"(nor a {' or '.join(sorted(FILE_CONFIGS)) or 'drafter'} file); give \"method\"")
    trained = _read_json(folder / "train_config.json").get("method")
    nested = cfg.get("dflash_config") or {}  # z-lab's and Gemma 4 DSpark folders may nest the block's keys
    block = cfg.get("block_size", nested.get("block_size"))
    if cfg.get("format") == "dspark-eagle3" or any("eagle" in a.lower() for a in cfg.get("architectures") or ()):
        return "eagle3", cfg.get("num_draft_tokens")
    if block is not None:
        anchor = cfg.get("sample_from_anchor")  # (the key the converter and Speculators read; false: zlab)
        zlab = anchor is False or (anchor is None and "dflash_config" in cfg)
        layout = cfg.get("slot_layout") or ("zlab" if zlab else "dspark")
        drafts = int(block) - (1 if layout == "zlab" else 0)
        if trained in ("dspark", "dflash"):
            return trained, drafts
        heads = int(cfg.get("markov_rank") or nested.get("markov_rank") or 0) > 0 or bool(
            cfg.get("enable_confidence_head") or nested.get("enable_confidence_head"))
        return ("dspark" if heads else "dflash"), drafts
    if cfg.get("model_type") == "gemma4_assistant":  # Gemma 4's assistant: vLLM's "mtp" (drafters/gemma4_assistant.py)
        return "mtp", None
    if any(a.endswith("ForCausalLM") for a in cfg.get("architectures") or ()):
        return "draft_model", None
    raise ValueError(f"cannot infer the speculative method from {folder / 'config.json'}; give \"method\"")


# vLLM's other spellings of a method
METHOD_ALIASES = {"[ngram]": "ngram", "qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp", "gemma4_assistant": "mtp"}


def normalize(d: dict[str, Any]) -> dict[str, Any]:
    """vLLM's keys mapped, `method` / `num_speculative_tokens` / n-gram lookup lengths filled in as vLLM
    would; the result is `SpecConfig` keyword arguments (unknown keys left for the caller to refuse)."""
    out = {k: v for k, v in d.items() if k not in VLLM_KEYS}
    for key, mapper in VLLM_KEYS.items():
        if key in d:
            for k, v in mapper(d[key], d).items():
                if k in d and d[k] != v:
                    raise ValueError(f"{key}={d[key]!r} sets {k}={v!r}, but {k}={d[k]!r} was given too")
                out[k] = v
    out["method"] = METHOD_ALIASES.get(out.get("method"), out.get("method"))
    if out.get("method") is None:
        if not out.get("model"):
            raise ValueError("speculative config needs 'method' (or a drafter 'model' to infer it from)")
        out["method"], drafts = infer_drafter(out["model"])
        if drafts and "num_speculative_tokens" not in out:
            out["num_speculative_tokens"] = drafts
    elif out.get("model") and "num_speculative_tokens" not in out and out["method"] != "draft_model":
        try:
            _, drafts = infer_drafter(out["model"])
        except ValueError:
            drafts = None  # the drafter's own loader says what is wrong with the folder
        if drafts:
            out["num_speculative_tokens"] = drafts
    if out["method"] == "ngram":
        lo, hi = out.get("prompt_lookup_min"), out.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = VLLM_NGRAM_LOOKUP
        out["prompt_lookup_min"] = lo if lo is not None else hi
        out["prompt_lookup_max"] = hi if hi is not None else lo
    return out
