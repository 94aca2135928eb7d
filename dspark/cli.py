"""`dspark` command line: subcommands are registered by their own modules (a registry, not an
if-chain); parsing happens in `main()` only.

    dspark serve [MODEL] [--speculative-config JSON] [--port 8000]
    dspark generate "prompt" [--max-tokens 128]
    dspark bench serve|sweep|offline ...
    dspark parity --speculative-config JSON --dataset gsm8k
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand → module exposing register(subparsers)
COMMANDS = {
    "serve": "dspark.server.cli",
    "generate": "dspark.cli_generate",
    "parity": "dspark.parity",
    "profile": "dspark.verify.profile_cli",
    "calibrate": "dspark.train.calibrate_cli",
    "prepare-data": "dspark.train.prepare_data",
    "train": "dspark.train.cli",
    "eval": "dspark.train.eval_accept",
}
# subcommand groups: `dspark bench serve|sweep|offline`
GROUPS = {
    "bench": ("serving and offline benchmarks",
              ["dspark.bench.cli", "dspark.bench.sweep", "dspark.bench.offline"]),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="Speculative-decoding inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        _register(module, sub)
    for name, (help_text, modules) in GROUPS.items():
        group = sub.add_parser(name, help=help_text).add_subparsers(dest=f"{name}_command", required=True)
        for module in modules:
            _register(module, group)
    return parser


def _register(module: str, sub) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return  # not in this checkout
        raise
    mod.register(sub)


def main(argv: list[str] | None = None) -> int:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dspark.config import EngineConfig
    from dspark.engine_args import expand_dotted, json_flags
    argv = expand_dotted(list(sys.argv[1:] if argv is None else argv), json_flags(EngineConfig))
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
