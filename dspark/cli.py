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
    """Flags shared by every command that builds an engine; defaults come from the dataclasses."""
    from dspark.config import (DTYPE_NAMES, MATMUL_DTYPES, CacheConfig, DEFAULT_MODEL, EngineConfig,
                               ParallelConfig, SchedulerConfig)
    if positional_model:
        p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                       help="GGUF file, HF folder (config.json + safetensors) or the embedded default")
    else:
        p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=list(DTYPE_NAMES),
                   help="weights, activations and KV cache; auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default=EngineConfig.device,
                   help="auto (cuda where torch sees a GPU, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no CUDA graphs (decode and verification steps are captured and replayed by default)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=ParallelConfig.tensor_parallel_size,
                   help="split the target over N processes (heads, MLP columns and vocabulary; gloo on the "
                        "CPU, NCCL on CUDA); the engine starts the workers itself")
    p.add_argument("--distributed-timeout-s", type=float, default=ParallelConfig.distributed_timeout_s,
                   help="a step's collective that does not finish in this many seconds (a rank stuck or gone) "
                        "stops the engine with an error")
    p.add_argument("--matmul-dtype", default=EngineConfig.matmul_dtype, choices=list(MATMUL_DTYPES),
                   help="the target's matrix products with --dtype float32: bfloat16 rounds weights and inputs "
                        "to bf16 and sums in fp32 (CPU kernels with AVX512-BF16); q4_1 multiplies a Q4_1 "
                        "GGUF's own blocks (CPU kernels with AVX2); auto: q4_1 for a Q4_1 GGUF where the kernels "
                        "support it, else bfloat16 where they support that, else float32")
    p.add_argument("--seed", type=int, default=EngineConfig.seed)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--coalesce-steps", type=int, default=SchedulerConfig.coalesce_steps)
    p.add_argument("--kv-block-size", type=int, default=CacheConfig.kv_block_size)
    p.add_argument("--kv-cache-memory-gb", type=float, default=CacheConfig.kv_cache_memory_gb)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--speculative-config", default=None,
                   help='vLLM schema, e.g. \'{"method": "dspark", "model": PATH, "num_speculative_tokens": 7}\'; '
                        '"none" disables the default drafter')


def engine_config_from_args(args: argparse.Namespace, *, default_spec=None):
    from dspark.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpecConfig
    spec_arg = args.speculative_config
    if spec_arg is None:
        spec = default_spec
    elif spec_arg.strip().lower() in ("none", "null", "off"):
        spec = None
    else:
        try:
            spec = SpecConfig.from_dict(spec_arg)
        except (ValueError, TypeError) as e:
            raise SystemExit(f"error: --speculative-config: {e}")
    try:
        return EngineConfig(
            model=args.model, dtype=args.dtype, matmul_dtype=args.matmul_dtype, seed=args.seed,
            num_threads=args.num_threads, device=args.device, enforce_eager=args.enforce_eager,
            parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                    distributed_timeout_s=args.distributed_timeout_s),
            cache=CacheConfig(kv_block_size=args.kv_block_size, kv_cache_memory_gb=args.kv_cache_memory_gb,
                              num_kv_blocks=args.num_kv_blocks,
                              enable_prefix_caching=not args.no_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      max_model_len=args.max_model_len,
                                      coalesce_steps=args.coalesce_steps),
            spec=spec)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


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
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
