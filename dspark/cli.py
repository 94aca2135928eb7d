"""`dspark` command line: subcommands are registered by their own modules (a registry, not an
if-chain); parsing happens in `main()` only.

    dspark serve [MODEL] [--speculative-config JSON] [--port 8000]
    dspark generate "prompt" [--max-tokens 128]
    dspark bench serve|sweep|offline ...
    dspark parity --speculative-config JSON --dataset gsm8k
    dspark build-corpus --data data/train --out corpus.safetensors
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand → module exposing register(subparsers)
COMMANDS = {
    "serve": "dspark.server.cli",
    "generate": "dspark.cli_generate",
    "parity": "dspark.parity",
    "profile": "dspark.cli_profile",
    "calibrate": "dspark.train.calibrate_cli",
    "prepare-data": "dspark.train.prepare_data",
    "build-corpus": "dspark.train.corpus_cli",
    "train": "dspark.train.cli",
    "eval": "dspark.train.eval_accept",
}
# subcommand groups: `dspark bench serve|sweep|offline` → (help, {its subcommand: module exposing register})
GROUPS = {
    "bench": ("serving and offline benchmarks",
              {"serve": "dspark.bench.cli", "sweep": "dspark.bench.sweep", "offline": "dspark.bench.offline"}),
}


def add_engine_args(p: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    """Flags shared by every command that builds an engine: generated from `EngineConfig`'s fields
    (`dspark.engine_args`; vLLM's spellings first), plus vLLM's flags that dspark refuses by name."""
    from dspark.config import EngineConfig
    from dspark.engine_args import add_arguments, add_refused_flags
    add_arguments(p, EngineConfig, positional_model=positional_model)
    add_refused_flags(p)


def engine_config_from_args(args: argparse.Namespace, *, default_spec=None):
    """The `EngineConfig` of parsed flags; `default_spec` where --speculative-config was not given."""
    import dataclasses

    from dspark.config import EngineConfig
    from dspark.engine_args import config_from_args
    try:
        config = config_from_args(args, EngineConfig)
        if getattr(args, "speculative_config", None) is None and default_spec is not None:
            config = dataclasses.replace(config, spec=default_spec)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"error: {e}")
    return config


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The `dspark` parser. Where `argv` names a known subcommand (or a group and one of its subcommands),
    only that command's module is imported and registered (`dspark serve` never imports the benchmarks'
    HTTP client); else every command is, for the help, the errors and no arguments."""
    named = _named(list(argv))
    commands, groups = named or (COMMANDS, GROUPS)
    parser = argparse.ArgumentParser(prog="dspark", description="Speculative-decoding inference engine")
    # one command registered: the usage line still names them all, as argparse writes a full parser's choices
    metavar = "{%s}" % ",".join([*COMMANDS, *GROUPS]) if named else None
    sub = parser.add_subparsers(dest="command", required=True, metavar=metavar)
    found = [_register(module, sub) for module in commands.values()]
    for name, (help_text, modules) in groups.items():
        group = sub.add_parser(name, help=help_text).add_subparsers(dest=f"{name}_command", required=True)
        found += [_register(module, group) for module in modules.values()]
    if named and not all(found):  # the named command's module is not in this checkout: the full parser's error
        return build_parser()
    return parser


def _named(argv: list[str]) -> tuple[dict, dict] | None:
    """(COMMANDS, GROUPS) narrowed to the one command `argv` starts with; None where it names none."""
    first = argv[0] if argv else None
    if first in COMMANDS:
        return {first: COMMANDS[first]}, {}
    if first in GROUPS and len(argv) > 1 and argv[1] in GROUPS[first][1]:
        help_text, modules = GROUPS[first]
        return {}, {first: (help_text, {argv[1]: modules[argv[1]]})}
    return None


def _register(module: str, sub) -> bool:
    """`module`'s commands added to `sub`; False where the module is not in this checkout."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return False
        raise
    mod.register(sub)
    return True


def main(argv: list[str] | None = None) -> int:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dspark.config import EngineConfig, SpecConfigError
    from dspark.engine_args import expand_dotted, json_flags
    argv = expand_dotted(list(sys.argv[1:] if argv is None else argv), json_flags(EngineConfig))
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        from dspark.models.files import CheckpointError  # a damaged model or drafter file, named in the message
        if isinstance(e, (SpecConfigError, CheckpointError)):
            raise SystemExit(f"error: {e}") from None
        raise


if __name__ == "__main__":
    sys.exit(main())
