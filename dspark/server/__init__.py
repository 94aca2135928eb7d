"""OpenAI-compatible HTTP server: `protocol` (request/response models), `async_engine` (the engine on
a background thread), `serving` (request → engine input, deltas → responses), `metrics`
(Prometheus), `app` (`build_app`, the FastAPI routes) and `cli` (`dspark serve`)."""
