"""Command-line flags and `LLM(**engine_args)` keywords, generated in one place from the config
dataclasses (`EngineConfig` with its nested `CacheConfig` / `SchedulerConfig`, `ServerConfig`) and their
`opt(...)` field metadata (`dspark.utils.options`): vLLM's spelling is the primary flag, dspark's older
spellings are aliases. A field added to a config dataclass is a flag and a keyword at once.

    add_arguments(parser, EngineConfig, positional_model=True)   # dspark serve [MODEL] --max-model-len 4k
    config = config_from_args(args, EngineConfig)
    config = config_from_kwargs(EngineConfig, {"max_model_len": 4096, "block_size": 16}, caller="LLM()")

Flags vLLM has and dspark does not honour are refused by name with the reason (`REFUSED_FLAGS`), never
accepted silently. A JSON option (`--speculative-config`) is also taken piecewise in vLLM's dotted form
(`--speculative-config.method ngram`, `expand_dotted`).
"""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any

# vLLM flag → why dspark refuses it (each names itself in the error)
REFUSED_FLAGS: dict[str, str] = {
    "--pipeline-parallel-size": "there is no pipeline parallelism",
    "--quantization": "a GGUF model is served in its own quantized blocks (see --matmul-dtype)",
    "--enable-lora": "LoRA adapters are not supported",
    "--lora-modules": "LoRA adapters are not supported",
    "--tokenizer": "the model's own tokenizer is used (GGUF metadata or tokenizer.json of the folder)",
    "--revision": "only local files are read; nothing is downloaded",
    "--download-dir": "only local files are read; nothing is downloaded",
    "--load-format": "the format is read from the model path (GGUF file or safetensors folder)",
    "--cpu-offload-gb": "weights are never offloaded",
    "--swap-space": "preempted requests are recomputed, never swapped",
    "--compilation-config": "there is no graph compilation to configure",
    "--limit-mm-per-prompt": "multimodal inputs are not supported",
    "--tokenizer-mode": "the model's own tokenizer is used",
    "--ssl-keyfile": "TLS is not served; put a reverse proxy in front",
    "--ssl-certfile": "TLS is not served; put a reverse proxy in front",
    "--allowed-origins": "CORS is not configurable",
    "--root-path": "the app is served at /",
}
SHORT_REFUSED = {"-pp": "--pipeline-parallel-size", "-q": "--quantization"}


@dataclass(frozen=True)
class Option:
    """One config field as a flag and keyword."""

    path: tuple[str, ...]  # attributes from the root config, e.g. ("cache", "kv_block_size")
    name: str  # keyword and argparse dest
    flags: tuple[str, ...]  # primary flag first
    kind: str  # bool | tuple | json | value
    base: type  # int, float, str (value and tuple kinds)
    default: Any
    meta: dict

    @property
    def keywords(self) -> tuple[str, ...]:
        """Names a keyword argument may use: the name, the field name, aliases without dashes."""
        names = [self.name, self.path[-1]] + [f.lstrip("-").replace("-", "_") for f in self.flags[1:]
                                              if f.startswith("--")]
        return tuple(dict.fromkeys(names))


def _base_type(hint) -> tuple[str, type]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if hint is bool:
        return "bool", bool
    if origin is tuple:
        return "tuple", args[0] if args else str
    if args and origin is not None:  # X | None
        return _base_type(args[0])
    return "value", hint if isinstance(hint, type) else str


def options(cls, path: tuple[str, ...] = ()) -> list[Option]:
    """Every option of a config dataclass, nested config dataclasses flattened (names must be unique)."""
    hints = typing.get_type_hints(cls)
    out: list[Option] = []
    for f in fields(cls):
        hint = hints[f.name]
        if is_dataclass(hint):
            out.extend(options(hint, path + (f.name,)))
            continue
        meta = dict(f.metadata.get("option") or {})
        name = meta.get("name") or f.name
        kind, base = _base_type(hint)
        if meta.get("json"):
            kind = "json"
        primary = meta.get("flag") or "--" + name.replace("_", "-")
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        out.append(Option(path + (f.name,), name, (primary, *meta.get("aliases", ())), kind, base, default, meta))
    if not path:
        _check_unique(out)
    return out


def _check_unique(opts: list[Option]) -> None:
    seen: dict[str, str] = {}
    for o in opts:
        for key in (*o.keywords, *o.flags):
            if seen.setdefault(key, o.name) != o.name:
                raise TypeError(f"config option spelling {key!r} is used by both {seen[key]} and {o.name}")


def _none_or(parse):
    def convert(text: str):
        return None if text.strip().lower() == "none" else parse(text)
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _help(o: Option) -> str:
    text = o.meta.get("help", "")
    if o.kind != "json" and o.default not in (None, (), ""):
        text += f" (default: {o.default})"
    return text


def add_arguments(parser: argparse.ArgumentParser, cls, *, positional_model: bool = False,
                  exclude: tuple[str, ...] = ()) -> None:
    """The flags of every option of `cls` (options named in `exclude` left out)."""
    group = parser.add_argument_group(cls.__name__)
    for o in options(cls):
        if o.name in exclude or not o.meta.get("cli", True):
            continue
        if o.name == "model" and positional_model:
            group.add_argument("model_positional", nargs="?", default=None, metavar="MODEL", help=_help(o))
            group.add_argument(*o.flags, dest="model", default=None, help="the same as MODEL")
            continue
        if o.kind == "bool":
            group.add_argument(*o.flags, dest=o.name, action=argparse.BooleanOptionalAction, default=o.default,
                               help=_help(o))
            for neg in o.meta.get("negatives", ()):
                group.add_argument(neg, dest=o.name, action="store_false", help=f"the same as --no-{o.flags[0][2:]}")
            continue
        kwargs: dict[str, Any] = {"dest": o.name, "default": o.default, "help": _help(o)}
        if o.kind == "json":
            kwargs.update(default=None, metavar="JSON")
        else:
            parse = o.meta.get("parse") or o.base
            kwargs["type"] = parse if o.meta.get("parse") or o.default is not None else _none_or(parse)
            if o.meta.get("choices"):
                kwargs["choices"] = o.meta["choices"]
            if o.kind == "tuple":
                kwargs["nargs"] = "+"
        group.add_argument(*o.flags, **kwargs)
        for flag, convert in o.meta.get("converted_aliases", {}).items():
            group.add_argument(flag, dest=o.name, type=convert, default=argparse.SUPPRESS, metavar="N",
                               help=f"{o.flags[0]} in another unit")


def add_refused_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that dspark does not honour: each fails naming itself and why."""
    taken = set(parser._option_string_actions)
    for flag, reason in REFUSED_FLAGS.items():
        shorts = [s for s, long in SHORT_REFUSED.items() if long == flag and s not in taken]
        if flag not in taken:
            parser.add_argument(flag, *shorts, nargs="?", action=_Refused, reason=reason, help=argparse.SUPPRESS)


class _Refused(argparse.Action):
    def __init__(self, option_strings, dest, reason: str = "", **kwargs):
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported by dspark: {self.reason}")


def json_flags(cls) -> tuple[str, ...]:
    return tuple(o.flags[0] for o in options(cls) if o.kind == "json")


def expand_dotted(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """vLLM's dotted form of a JSON flag (`--speculative-config.method ngram`,
    `--speculative-config.num_speculative_tokens=3`) folded into one `--speculative-config JSON`; values
    are JSON where they parse as JSON (numbers, true/false), else strings; a JSON object given whole is
    merged first."""
    pieces: dict[str, dict] = {}
    whole: dict[str, str] = {}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag = next((f for f in flags if arg.startswith(f + ".")), None)
        if flag is None:
            if arg in flags and i + 1 < len(argv) and any(a.startswith(arg + ".") for a in argv):
                whole[arg] = argv[i + 1]
                i += 2
                continue
            out.append(arg)
            i += 1
            continue
        key, eq, value = arg[len(flag) + 1:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise SystemExit(f"error: {arg} needs a value")
            value, i = argv[i + 1], i + 1
        target = pieces.setdefault(flag, {})
        *parents, leaf = key.replace("-", "_").split(".")
        for p in parents:
            target = target.setdefault(p, {})
        try:
            target[leaf] = json.loads(value)
        except json.JSONDecodeError:
            target[leaf] = value
        i += 1
    for flag, d in pieces.items():
        base = {}
        if flag in whole:
            try:
                base = json.loads(whole[flag])
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {flag} is not valid JSON: {e}") from None
        out += [flag, json.dumps({**base, **d})]
    return out


def _build(cls, values: dict[tuple[str, ...], Any], path: tuple[str, ...] = ()):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, path + (f.name,))
        elif path + (f.name,) in values:
            kwargs[f.name] = values[path + (f.name,)]
    return cls(**kwargs)


def _convert(o: Option, value):
    parse = o.meta.get("parse")
    if o.kind == "json":
        return parse(value) if parse else value
    if o.kind == "tuple":
        return tuple([value] if isinstance(value, str) else value)
    if isinstance(value, str) and parse is not None:
        return parse(value)
    return value


def config_from_args(args: argparse.Namespace, cls):
    """`cls` built from parsed flags (options whose flag was not added keep the dataclass default).
    Raises ValueError naming the flag of a bad value."""
    values = {}
    for o in options(cls):
        if o.name == "model" and hasattr(args, "model_positional"):
            pos, flag = args.model_positional, getattr(args, "model", None)
            if pos and flag and pos != flag:
                raise ValueError(f"the model is given twice: {pos!r} and --model {flag!r}")
            value = pos or flag
        else:
            value = getattr(args, o.name, MISSING)
        if value is MISSING or (value is None and o.kind == "json") or (value is None and o.name == "model"):
            continue
        try:
            values[o.path] = _convert(o, value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"{o.flags[0]}: {e}") from None
    try:
        return _build(cls, values)
    except ValueError as e:  # a dataclass check: say which flag it is about
        raise ValueError(_name_flag(cls, str(e))) from None


def _name_flag(cls, message: str) -> str:
    """`message` prefixed with the flag of the first option whose field it names."""
    import re
    for o in sorted(options(cls), key=lambda o: -len(o.path[-1])):
        if o.kind != "json" and re.search(rf"\b{re.escape(o.path[-1])}\b", message):
            return f"{o.flags[0]}: {message}"
    return message


def config_from_kwargs(cls, kwargs: dict[str, Any], *, caller: str = "LLM()"):
    """`cls` from keyword arguments spelled as vLLM's engine args (or dspark's aliases). Unknown or refused
    keywords raise TypeError naming every one of them."""
    by_keyword = {k: o for o in options(cls) for k in o.keywords}
    converted = {flag.lstrip("-").replace("-", "_"): (o, fn) for o in options(cls)
                 for flag, fn in o.meta.get("converted_aliases", {}).items()}
    refused = {f.lstrip("-").replace("-", "_"): r for f, r in REFUSED_FLAGS.items()}
    bad = [k for k in kwargs if k in refused]
    if bad:
        raise TypeError(f"{caller}: " + "; ".join(f"{k} is not supported by dspark: {refused[k]}" for k in bad))
    unknown = sorted(k for k in kwargs if k not in by_keyword and k not in converted)
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword argument(s): {', '.join(unknown)}")
    values: dict[tuple[str, ...], Any] = {}
    for key, value in kwargs.items():
        if key in converted:
            o, fn = converted[key]
            values[o.path] = fn(str(value))
            continue
        o = by_keyword[key]
        if o.path in values:
            raise TypeError(f"{caller}: {key} and another spelling of {o.name} were both given")
        values[o.path] = _convert(o, value)
    return _build(cls, values)
