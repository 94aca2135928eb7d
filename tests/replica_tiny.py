"""The tiny test engine as a replica factory (`ReplicaLaunch(factory="replica_tiny:tiny_engine", args=...)`):
what `dspark serve --data-parallel-size N` builds from its command line, built here from the test harness's
random-weight model. args: "spec" (a speculative config dict, or absent for none), "step_sleep_s" (every
step that much longer, so a test can act while requests run)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from server_harness import CharTokenizer, build_tiny_model, make_engine, slowed  # noqa: E402

from dspark.config import SpecConfig  # noqa: E402

TESTS = Path(__file__).parent


def tiny_engine(args: dict):
    spec = args.get("spec")
    engine = make_engine(build_tiny_model(), spec=None if spec is None else SpecConfig.from_dict(spec))
    if args.get("step_sleep_s"):
        engine = slowed(engine, args["step_sleep_s"])
    return engine, CharTokenizer()


def launch_env() -> dict:
    """The environment a replica needs to import this module (and dspark from this checkout)."""
    import os
    paths = [str(TESTS), str(TESTS.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(paths)}


@contextlib.contextmanager
def serve_replicas(size: int = 2, *, config=None, pin_cores: bool = False, **args):
    """A `ReplicaSet` of `size` tiny replicas (built with `args`) behind the app on 127.0.0.1
    (`server_harness.run_app`) -> (base URL, the replica set); shut down after."""
    from dspark.server.app import build_app
    from dspark.server.replicas import ReplicaLaunch, ReplicaSet
    from server_harness import MODEL, run_app

    from dspark.server.config import ServerConfig
    limits = config or ServerConfig()
    replicas = ReplicaSet(ReplicaLaunch("replica_tiny:tiny_engine", args, env=launch_env()), size,
                          tokenizer=CharTokenizer(), threads=1, pin_cores=pin_cores, model_name=MODEL,
                          max_num_waiting=limits.max_num_waiting, request_timeout_s=limits.request_timeout_s).launch()
    try:
        with run_app(build_app(replicas, model_name=MODEL, config=config)) as url:
            yield url, replicas
    finally:
        replicas.shutdown()
