"""`dspark serve [MODEL]`: build the engine and serve the OpenAI-compatible API with uvicorn.

    dspark serve                                   # the embedded default model, 127.0.0.1:8000
    dspark serve ./SmolLM2-360M --port 8001 --api-key secret --served-model-name smol smol-360m
    dspark serve MODEL --max-model-len 4k --speculative-config.method ngram \
        --speculative-config.num_speculative_tokens 4
    dspark serve --data-parallel-size 2            # two engine processes, one API server (docs/replicas.md)
    dspark serve MODEL -tp 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1   # host 1 of 2 (serves HTTP)
    dspark serve MODEL -tp 2 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1   # host 2 of 2 (headless)

The flags are generated from `EngineConfig` and `ServerConfig` (dspark.engine_args), in vLLM's spellings.

Without --speculative-config the model's shipped drafter (if any) is used; "none" turns it off.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

log = logging.getLogger(__name__)



def register(sub) -> None:
    from dspark.cli import add_engine_args
    from dspark.server.config import add_server_args
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(p)
    add_server_args(p)  # address, names, keys, logging, admission, deadline, body limit, drain
    p.set_defaults(func=run)


def default_spec(config):
    """The drafter shipped for the model (dspark.drafters.shipped), with the cost table of the engine's
    matmul dtype, or None when there is none."""
    from dspark.drafters.shipped import default_spec_config
    from dspark.engine.build import resolve_matmul_dtype
    return default_spec_config(config.model, matmul_dtype=resolve_matmul_dtype(
        config.matmul_dtype, dtype=config.dtype, device=config.device, model=config.model,
        tensor_parallel_size=config.tensor_parallel_size))


def configs_from_args(args: argparse.Namespace):
    """(EngineConfig, ServerConfig) of `dspark serve`'s flags; the shipped drafter where
    --speculative-config was not given."""
    import dataclasses

    from dspark.cli import engine_config_from_args
    from dspark.server.config import server_config_from_args
    from dspark.distributed.rendezvous import from_environment
    server = server_config_from_args(args)
    config = engine_config_from_args(args)
    try:  # torchrun's environment where the flags leave the tensor-parallel group on one host
        config = dataclasses.replace(config, parallel=from_environment(config.parallel, os.environ))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.speculative_config is None:  # (an explicit "default" is resolved by build_engine)
        config = dataclasses.replace(config, spec=default_spec(config))
    return config, server


def run(args: argparse.Namespace) -> int:
    from dspark.engine.build import build_engine
    from dspark.server.app import build_app
    from dspark.server.async_engine import AsyncEngine

    from dspark.distributed.rendezvous import ConfigMismatch

    config, server_config = configs_from_args(args)
    logging.getLogger().setLevel(_python_level(server_config.uvicorn_log_level))
    if server_config.data_parallel_size > 1:
        return run_replicas(args, config, server_config)
    try:
        if config.parallel.node_rank > 0:  # multi-node tensor parallelism: this node's ranks, no HTTP
            from dspark.engine.build import run_tensor_parallel_node
            return run_tensor_parallel_node(config)
        engine, tokenizer = build_engine(config)
    except ConfigMismatch as e:
        raise SystemExit(f"error: {e}") from None
    if server_config.chat_template:
        from dspark.models.tokenizer import with_chat_template
        tokenizer = with_chat_template(tokenizer, server_config.chat_template)
    model_names = server_config.served_model_name or (config.model,)
    spec = engine.config.spec.method if engine.config.spec else "none"  # "default" resolved
    log.info("serving %s as %s on http://%s:%d (speculation: %s)", config.model,
             ", ".join(repr(n) for n in model_names), server_config.host, server_config.port, spec)
    async_engine = AsyncEngine(engine, tokenizer, own_thread=False, max_num_waiting=server_config.max_num_waiting,
                               request_timeout_s=server_config.request_timeout_s, model_name=model_names[0])
    app = build_app(async_engine, model_name=model_names, config=server_config)
    return serve_app(app, async_engine, host=server_config.host, port=server_config.port,
                     log_level=server_config.uvicorn_log_level, drain_timeout_s=server_config.drain_timeout_s,
                     max_connections=server_config.max_connections)


def check_data_parallel(config, server_config) -> None:
    """What --data-parallel-size cannot combine with, refused before any replica starts."""
    size = server_config.data_parallel_size
    if str(config.device).startswith("cuda"):
        raise SystemExit(f"error: --data-parallel-size {size} runs CPU replicas on this host; on CUDA run one "
                         f"dspark serve per GPU behind a router (docs/replicas.md)")
    if config.parallel.nnodes > 1:
        raise SystemExit(f"error: --data-parallel-size {size} with --nnodes {config.parallel.nnodes}: replicas "
                         f"and multi-node tensor parallelism do not combine; run one multi-node server per "
                         f"replica behind a router (docs/replicas.md)")


def run_replicas(args: argparse.Namespace, config, server_config) -> int:
    """`dspark serve --data-parallel-size N`: N engine processes (dspark.server.replicas) behind one API
    server; each builds its engine from this command line (`replica_engine`) with its share of the cores."""
    from dspark.models.loader import read_model_config, resolve_model_path
    from dspark.models.tokenizer import load_tokenizer
    from dspark.server.app import build_app
    from dspark.server.replicas import ReplicaLaunch, ReplicaSet

    check_data_parallel(config, server_config)
    size = server_config.data_parallel_size
    tokenizer = load_tokenizer(resolve_model_path(config.model), eos_token_ids=read_model_config(config.model).eos_token_ids)
    if server_config.chat_template:
        from dspark.models.tokenizer import with_chat_template
        tokenizer = with_chat_template(tokenizer, server_config.chat_template)
    model_names = server_config.served_model_name or (config.model,)
    flags = {k: v for k, v in vars(args).items() if k != "func"}  # plain values: the replicas parse them again
    replicas = ReplicaSet(ReplicaLaunch("dspark.server.cli:replica_engine", {"flags": flags}), size,
                          tokenizer=tokenizer, engine_config=config, threads=config.num_threads,
                          model_name=model_names[0], max_num_waiting=server_config.max_num_waiting,
                          request_timeout_s=server_config.request_timeout_s,
                          log_level=server_config.uvicorn_log_level)
    log.info("serving %s as %s on http://%s:%d with %d replicas of %d torch threads", config.model,
             ", ".join(repr(n) for n in model_names), server_config.host, server_config.port, size, replicas.threads)
    replicas.launch()
    app = build_app(replicas, model_name=model_names, config=server_config)
    return serve_app(app, replicas, host=server_config.host, port=server_config.port,
                     log_level=server_config.uvicorn_log_level, drain_timeout_s=server_config.drain_timeout_s,
                     max_connections=server_config.max_connections)


def replica_engine(args: dict):
    """A replica's engine (dspark.server.replica): `dspark serve`'s flags as the API process parsed them, with
    the replica's torch threads -> (engine, tokenizer)."""
    import dataclasses

    from dspark.engine.build import build_engine
    config, _ = configs_from_args(argparse.Namespace(**args["flags"]))
    import torch
    return build_engine(dataclasses.replace(config, num_threads=torch.get_num_threads()))


def _python_level(level: str) -> int:
    return logging.DEBUG if level == "trace" else getattr(logging, level.upper())


def serve_app(app, async_engine, *, host: str, port: int, log_level: str = "info",
              drain_timeout_s: float = 30.0, max_connections: int | None = None) -> int:
    """Serve until SIGTERM / SIGINT or the engine's death. The engine loop runs on the main thread
    (see dspark.server.async_engine); uvicorn's event loop runs beside it and installs no signal
    handlers there. SIGTERM drains: no new requests (503), running ones finish within
    `drain_timeout_s` (the rest are aborted), then exit 0; a second SIGTERM or a SIGINT stops at
    once. Returns 1 when the engine loop died."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5,
                                           limit_concurrency=max_connections))
    http = threading.Thread(target=server.run, name="dspark-http", daemon=True)

    def on_sigterm(signum, frame) -> None:
        if async_engine.draining:
            raise KeyboardInterrupt
        log.info("SIGTERM: draining (no new requests; up to %g s for the running ones)",
                 drain_timeout_s)
        async_engine.begin_drain(drain_timeout_s)

    signal.signal(signal.SIGTERM, on_sigterm)
    http.start()
    try:
        async_engine.run_forever()  # returns when drained, when the app shuts down, or on death
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(10.0)
        async_engine.shutdown()
    if async_engine.error is not None:
        log.error("the engine loop died (%s); exiting", async_engine.error)
        return 1
    return 0
