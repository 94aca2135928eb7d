"""`python tests/serve_tiny.py PORT [--drain-timeout-s S] [--step-sleep-s S] [--fail-at-step N]
[--max-connections N]`:
the tiny test engine served by `dspark.server.cli.serve_app`, the loop `dspark serve` runs (engine
on the main thread, SIGTERM drains), for tests that need a real process and real signals."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from server_harness import MODEL, CharTokenizer, build_tiny_model, make_engine  # noqa: E402

from dspark.server.app import build_app  # noqa: E402
from dspark.server.async_engine import AsyncEngine  # noqa: E402
from dspark.server.cli import serve_app  # noqa: E402
from dspark.server.config import ServerConfig  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--max-connections", type=int, default=None)
    args = p.parse_args()
    engine = make_engine(build_tiny_model())
    real_step = engine.step

    def step():
        if args.fail_at_step is not None and engine.metrics.num_steps >= args.fail_at_step:
            raise RuntimeError("planted engine fault")
        time.sleep(args.step_sleep_s)
        return real_step()

    engine.step = step
    config = ServerConfig(drain_timeout_s=args.drain_timeout_s)
    async_engine = AsyncEngine(engine, CharTokenizer(), own_thread=False, max_num_waiting=config.max_num_waiting,
                               model_name=MODEL)
    app = build_app(async_engine, model_name=MODEL, config=config)
    return serve_app(app, async_engine, host="127.0.0.1", port=args.port, log_level="warning",
                     drain_timeout_s=config.drain_timeout_s, max_connections=args.max_connections)


if __name__ == "__main__":
    sys.exit(main())
