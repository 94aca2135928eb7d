"""OpenAI-compatible HTTP server: `protocol` (request/response models), `async_engine` (the engine on
a background thread), `serving` (request → engine input, deltas → responses), `metrics`
(Prometheus), `routes` (the routes as plain functions), `app` (`build_app`) and `cli` (`dspark serve`)."""
