"""Field metadata for the config dataclasses: one place says how a field is spelled on the command line
and in `LLM(**engine_args)` (vLLM's spelling first, dspark's older spellings as aliases), how its text
is parsed and what its help says. `dspark.engine_args` turns these into argparse flags and keyword
arguments; nothing else declares engine or server flags by hand.

    max_model_len: int | None = opt(None, "context length (4k = 4000, 4K = 4096)", parse=human_int)
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, field
from typing import Any, Callable

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str | int) -> int:
    """An integer with an optional size suffix, as vLLM reads them: lower case decimal (`4k` = 4000,
    `25.6k` = 25600), upper case binary (`4K` = 4096, decimals refused)."""
    if isinstance(text, int):
        return text
    value = str(text).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", value)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid integer {value!r} (e.g. 4096, 4k, 4K)")
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: decimals need a decimal suffix (k, m, g, t)")
    return int(number) * _BINARY.get(suffix, 1)


def optional_human_int(text: str | int | None) -> int | None:
    """`human_int`, or None for "none" / "auto"."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("none", "auto")):
        return None
    return human_int(text)


def opt(default: Any = MISSING, help: str = "", *, flag: str | None = None,
        aliases: tuple[str, ...] = (), converted_aliases: dict[str, Callable[[str], Any]] | None = None,
        negatives: tuple[str, ...] = (), parse: Callable[[str], Any] | None = None,
        choices: tuple[str, ...] | None = None, name: str | None = None, cli: bool = True,
        json: bool = False, default_factory: Any = MISSING) -> Any:
    """A dataclass field with its command-line / keyword spelling.

    flag: the primary flag (default `--` + the keyword with dashes); name: the keyword in
    `LLM(**engine_args)` and the argparse dest (default: the field name); aliases: more flags (and,
    without dashes, keywords) for the same value; converted_aliases: flags whose text means the value
    in another unit (`--kv-cache-memory-gb 2` → bytes); negatives: extra flags that set a bool False;
    parse: text → value; json: the value is a JSON object, also given piecewise as `--flag.key value`;
    cli=False: a keyword only (tests, embedded use)."""
    meta = {"help": help, "flag": flag, "aliases": tuple(aliases), "negatives": tuple(negatives),
            "converted_aliases": dict(converted_aliases or {}), "parse": parse, "choices": choices,
            "name": name, "cli": cli, "json": json}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={"option": meta})
    return field(default=default, metadata={"option": meta})
