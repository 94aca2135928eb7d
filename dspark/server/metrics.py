"""Prometheus metrics for one app: a private registry (several apps can live in one process, as in
tests), under vLLM's names and labels: the `vllm:` prefix, `model_name` (the first served name) and
`engine` ("0") on every series, `finished_reason` on `vllm:request_success_total`, so dashboards built for
vLLM read dspark unchanged. dspark's own series (draft gate, measured switch, cost table, verify budget,
coalescing) follow the same convention.

Counters that the engine already counts (tokens, spec-decode drafts) are not double-kept: a custom
collector reads one `ServerStats` snapshot (the async engine's, with the engine's `EngineStats`) at scrape time,
so they are exact. Request-level latencies are histograms observed when a request ends (`on_request_end`, called
by the async engine that owns these metrics, on the engine thread; prometheus_client metrics are thread-safe). The
verify-budget and coalescing histograms are fed from the engine's drained samples
(`AsyncEngine.drain_histogram_samples`) at each request end and each scrape. τ (mean tokens per verification round) is derived from the counters at scrape
time, and the cost table the length policy is using (live, if online upkeep refreshes it) is one
gauge sample per profiled point. The per-position acceptance counter has a series for every draft position
0..K-1 from the start (K = the drafter's drafts per step), as vLLM's does.

Latencies as vLLM defines them: `vllm:inter_token_latency_seconds` one observation per gap between two
steps that gave a request output (with speculation a step can carry several tokens), and
`vllm:request_time_per_output_token_seconds` one per request: (end - first token) / (output tokens - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dspark.engine.metrics import EngineStats

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                  0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0)
VERIFY_BUDGET_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
COALESCE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
PREFIX = "vllm:"
LABELS = ["model_name", "engine"]


@dataclass(frozen=True)
class RequestRecord:
    """One finished (or aborted) request, for latency histograms and the success counter."""

    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_s: float  # time.perf_counter() at add_request
    first_token_s: float | None  # when the first output token left the engine thread
    end_s: float
    token_times_s: tuple[float, ...] = ()  # when each step's output tokens left the engine thread


@dataclass(frozen=True)
class ServerStats:
    """One snapshot of what the app reports (`AsyncEngine.stats()`, `ReplicaSet.stats()`): /health, /get_load,
    /metrics and the stats line each read one."""

    healthy: bool = True  # the engine loop runs (a replica set: some replica serves)
    error: str | None = None  # why it does not
    health: dict = field(default_factory=lambda: {"status": "ok"})  # /health's body while healthy
    num_running: int = 0  # requests being scheduled (a replica set: every request its replicas hold)
    num_queued: int = 0  # admitted but not yet running (a replica set: 0, each replica counts its own)
    num_active: int = 0  # requests with a live stream
    num_rejected: dict = field(default_factory=dict)  # HTTP status -> admission refusals
    num_failed: int = 0  # requests ended by their own fault (500) or deadline (504)
    engine: EngineStats | None = None  # the engine's, where it runs in this process


class _EngineCollector:
    """Reads one `ServerStats` snapshot at scrape time."""

    def __init__(self, stats: Callable[[], ServerStats], labels: list[str] | None = None):
        self.stats = stats
        self.labels = labels or ["dspark", "0"]  # [model_name, engine]

    def describe(self):
        return []  # no up-front description: register() must not call collect() early

    def _family(self, kind, name: str, doc: str, extra: list[str] | None = None):
        return kind(PREFIX + name, doc, labels=LABELS + (extra or []))

    def _one(self, kind, name: str, doc: str, value: float):
        family = self._family(kind, name, doc)
        family.add_metric(self.labels, value)
        return family

    def collect(self):
        stats = self.stats()
        m = stats.engine

        def counter(name: str, doc: str, value: float):
            return self._one(CounterMetricFamily, name, doc, value)

        def gauge(name: str, doc: str, value: float):
            return self._one(GaugeMetricFamily, name, doc, value)

        yield counter("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                      m.num_prompt_tokens)
        yield counter("generation_tokens", "Output tokens produced by the engine.",
                      m.num_generation_tokens)
        yield counter("num_preemptions", "Requests preempted by recompute.", m.num_preemptions)
        yield counter("prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache.",
                      m.num_prefix_cache_queries)
        yield counter("prefix_cache_hits", "Tokens of admitted requests found in the prefix cache.",
                      m.num_prefix_cache_hits)
        yield counter("spec_decode_num_drafts", "Verification rounds that carried drafts.",
                      m.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", m.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      m.num_accepted_tokens)
        yield counter("spec_decode_num_wasted_verify_tokens",
                      "Verified draft tokens that were rejected.", m.num_wasted_verify_tokens)
        yield counter("spec_decode_num_draft_skips",
                      "Request-steps without model drafts because the draft gate found drafting "
                      "could not pay under the load (prompt lookup may still draft them).", m.num_draft_skips)
        yield counter("spec_decode_num_proposal_skips",
                      "Steps without any proposal (lookup or model): under the load the draft gate "
                      "found that prompt lookup's drafts could not pay for proposing them, or the measured "
                      "switch held speculation off (those also in spec_decode_num_measured_off_steps).",
                      m.num_proposal_skips)
        yield counter("spec_decode_num_measured_off_steps",
                      "Steps without any proposal because, at the load, speculative decode steps measured "
                      "no faster per emitted token than plain ones (measured_switch).",
                      m.num_measured_off_steps)
        yield counter("spec_decode_num_lookup_drafts",
                      "Request-steps drafted by prompt lookup instead of the model drafter "
                      "(ngram_first).", m.num_lookup_drafts)
        yield counter("spec_decode_num_admitted_without_drafter",
                      "Requests admitted while the draft gate stayed closed: no drafter context, prompt "
                      "lookup only (gate_admission).", m.num_admitted_without_drafter)
        per_pos = self._family(CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                               "Accepted draft tokens by draft position.", ["position"])
        accepted = m.accepted_per_pos
        num_pos = max(len(accepted), m.num_draft_positions)
        for pos in range(num_pos):
            per_pos.add_metric(self.labels + [str(pos)], accepted[pos] if pos < len(accepted) else 0)
        yield per_pos
        tau = 1.0 + m.num_accepted_tokens / m.num_drafts if m.num_drafts else 1.0
        yield gauge("spec_decode_mean_acceptance_length",
                    "Mean tokens per verification round with drafts (tau, bonus included).", tau)
        if m.cost_table is not None:
            sps = self._family(GaugeMetricFamily, "cost_table_sps", "Verification steps per second at "
                               "num_tokens, from the cost table in use.", ["num_tokens"])
            for num_tokens, value in m.cost_table:
                sps.add_metric(self.labels + [str(num_tokens)], value)
            yield sps
        if m.switch is not None:
            on = self._family(GaugeMetricFamily, "measured_switch_on", "Speculation on (1) or off (0) at a "
                              "load (requests in a step) and context (its longest request's tokens), as the measured "
                              "switch decided it.", ["load", "context"])
            per_token = self._family(GaugeMetricFamily, "measured_switch_seconds_per_token",
                                     "Seconds of an engine decode step per emitted token at a load and context, with "
                                     "speculation and without (measured switch).", ["load", "context", "mode"])
            for label, context, is_on, spec, plain in m.switch:
                on.add_metric(self.labels + [label, context], float(is_on))
                for mode, value in (("speculative", spec), ("plain", plain)):
                    if value is not None:
                        per_token.add_metric(self.labels + [label, context, mode], value)
            yield on
            yield per_token
        yield gauge("kv_cache_usage_perc", "KV-cache usage (1 = full).", m.kv_usage)
        yield from self._cache_config_info(m)
        if m.num_state_slots:  # a hybrid target's recurrent state slots
            yield gauge("num_state_slots_used", "Recurrent state slots held by requests (hybrid targets).",
                        m.num_used_state_slots)
            yield gauge("num_state_slots", "Recurrent state slots in all (hybrid targets).", m.num_state_slots)
        if m.num_state_snapshots:  # a hybrid's prefix cache
            yield gauge("num_state_snapshots_used", "Recurrent-state snapshots kept for cached blocks or being "
                        "written (hybrid targets' prefix caching).", m.num_used_snapshots)
            yield gauge("num_state_snapshots", "Recurrent-state snapshot entries in all (hybrid targets).",
                        m.num_state_snapshots)
            yield counter("state_snapshot_hits", "Prefix-cache hits that resumed a hybrid target's recurrence "
                          "from a state snapshot.", m.num_snapshot_hits)
            yield counter("state_snapshots_stored", "Recurrent-state snapshots kept at block boundaries.",
                          m.num_snapshots_stored)
            yield counter("state_snapshots_evicted", "Recurrent-state snapshots dropped: their block left the "
                          "prefix cache, or a newer snapshot took the entry.", m.num_snapshots_evicted)
        yield gauge("num_requests_waiting", "Requests waiting for admission.", m.num_waiting)
        yield gauge("num_requests_running", "Requests being scheduled.", m.num_running)
        yield from self._reliability_families(stats)

    def _cache_config_info(self, m: EngineStats):
        """vLLM's info gauge (value 1) whose labels carry the KV pool's shape: the Gateway API Inference
        Extension's prefix-cache scorer reads `block_size` and `num_gpu_blocks` from it."""
        if not m.kv_block_size:
            return
        info = self._family(GaugeMetricFamily, "cache_config_info", "Information of the engine's cache "
                            "configuration (value 1; the labels carry it).", ["block_size", "num_gpu_blocks"])
        info.add_metric(self.labels + [str(m.kv_block_size), str(m.num_kv_blocks)], 1.0)
        yield info

    def _reliability_families(self, stats: ServerStats):
        """Admission refusals, requests failed on their own, and the engine's fault fallbacks."""
        rejected = self._family(CounterMetricFamily, "num_requests_rejected", "Requests refused at admission: "
                                "429 past max_num_waiting, 503 while draining.", ["status"])
        for status, value in sorted(stats.num_rejected.items()):
            rejected.add_metric(self.labels + [str(status)], value)
        yield rejected
        yield self._one(CounterMetricFamily, "num_requests_failed",
                        "Requests ended by their own fault (500) or their deadline (504).", stats.num_failed)
        yield self._one(CounterMetricFamily, "spec_decode_num_draft_faults",
                        "Request-steps decoded plainly because the drafter raised or returned non-finite or "
                        "out-of-range drafts.", stats.engine.num_draft_faults)


class ServerMetrics:
    def __init__(self, source, *, model_name: str = "dspark", engine: str = "0"):
        """`source`: the async engine these metrics observe (its `stats()` snapshot at each scrape, its drained
        histogram samples); it calls `on_request_end` as each of its requests ends."""
        self.source = source
        self.labels = [model_name, engine]  # `engine`: the replica's index under --data-parallel-size
        self.registry = CollectorRegistry(auto_describe=False)

        def histogram(name: str, doc: str, buckets):
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*self.labels)

        self.request_success = Counter(PREFIX + "request_success", "Finished requests.",
                                       LABELS + ["finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(*self.labels, reason)
        self.ttft_s = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S)
        self.itl_s = histogram("inter_token_latency_seconds",
                               "Time between two steps that gave a request output tokens.", TPOT_BUCKETS_S)
        self.tpot_s = histogram("request_time_per_output_token_seconds",
                                "Per request: time per output token after the first.", TPOT_BUCKETS_S)
        self.e2e_s = histogram("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS_S)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                       TOKEN_COUNT_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens", "Output tokens per finished request.",
                                           TOKEN_COUNT_BUCKETS)
        self.verify_budget = histogram("spec_decode_verify_budget",
                                       "Drafts verified per request per step (verify length).", VERIFY_BUDGET_BUCKETS)
        self.coalesce_held = histogram("coalesce_held_steps",
                                       "Steps a request's prompt was held back by coalescing.", COALESCE_BUCKETS)
        self.registry.register(_EngineCollector(source.stats, self.labels))

    def on_request_end(self, record: RequestRecord) -> None:
        self.request_success.labels(*self.labels, record.finish_reason).inc()
        self.e2e_s.observe(record.end_s - record.arrival_s)
        self.prompt_tokens.observe(record.num_prompt_tokens)
        self.generation_tokens.observe(record.num_output_tokens)
        if record.first_token_s is not None:
            self.ttft_s.observe(record.first_token_s - record.arrival_s)
            if record.num_output_tokens > 1:
                self.tpot_s.observe((record.end_s - record.first_token_s)
                                    / (record.num_output_tokens - 1))
        times = getattr(record, "token_times_s", ())
        for earlier, later in zip(times, times[1:]):
            self.itl_s.observe(later - earlier)
        self._drain_verify_lens()

    def _drain_verify_lens(self) -> None:
        verify_lens, coalesce_held_steps = self.source.drain_histogram_samples()
        for verify_len in verify_lens:
            self.verify_budget.observe(verify_len)
        for held in coalesce_held_steps:
            self.coalesce_held.observe(held)

    def render(self) -> bytes:
        self._drain_verify_lens()
        return generate_latest(self.registry)

    async def render_async(self) -> bytes:
        """`render`, as the /metrics route awaits it (a replica set gathers its replicas' texts)."""
        return self.render()


def merge_expositions(texts: list[str]) -> bytes:
    """One Prometheus text of several (the replicas' own, each under its `engine` label): each family once,
    with the samples of every text, its type and help as the first text that has it gives them."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, object] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            known = families.setdefault(family.name, family)
            if known is not family:
                known.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CollectedFamilies(list(families.values())))
    return generate_latest(registry)


class CollectedFamilies:
    """A collector yielding families built elsewhere (parsed, or made at a scrape) as they are."""

    def __init__(self, families: list):
        self.families = families

    def describe(self):
        return []

    def collect(self):
        return iter(self.families)
