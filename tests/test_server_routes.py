"""The routes are plain functions over `request.app.state`: each runs against a bare app whose state holds a stub
engine (a `stats()` snapshot, limits, metrics) and `Settings`, with no engine, engine thread or `build_app`."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.testclient import TestClient

from dspark.engine.metrics import EngineStats
from dspark.server import routes
from dspark.server.app import _install_error_handlers
from dspark.server.metrics import ServerStats


class StubEngine:
    """What the routes read of an engine: `stats()`, `max_model_len` and `metrics`."""

    max_model_len = 512

    def __init__(self, stats: ServerStats):
        self.snapshot = stats
        self.metrics = self

    def stats(self) -> ServerStats:
        return self.snapshot

    async def render_async(self) -> bytes:
        return b"# stub\n"


def app_with(stats: ServerStats, names=("tiny", "tiny-alias")) -> TestClient:
    app = FastAPI()
    _install_error_handlers(app)
    app.include_router(routes.router)
    app.state.engine = StubEngine(stats)
    app.state.settings = routes.Settings(names=tuple(names), model_root="/models/tiny")
    return TestClient(app)


def test_health_reads_the_snapshot_alone():
    client = app_with(ServerStats(health={"status": "degraded", "replicas": []}))
    assert client.get("/health").json() == {"status": "degraded", "replicas": []}
    down = app_with(ServerStats(healthy=False, error="boom")).get("/health")
    assert down.status_code == 503
    assert down.json()["error"] == {"message": "engine is not running: boom", "type": "service_unavailable",
                                    "param": None, "code": 503}


def test_models_and_load_from_a_stub_state():
    client = app_with(ServerStats(num_running=3, num_queued=2, engine=EngineStats()))
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["max_model_len"]) for c in cards] == [
        ("tiny", "/models/tiny", 512), ("tiny-alias", "/models/tiny", 512)]
    assert client.get("/get_load").json() == {"load": 5, "num_reqs": 3, "num_waiting_reqs": 2}
    assert client.get("/metrics").text == "# stub\n"


def test_a_route_is_a_plain_function():
    stats = ServerStats(health={"status": "ok"})
    assert asyncio.run(routes.health(StubEngine(stats))) == {"status": "ok"}
