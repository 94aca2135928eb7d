"""Prometheus metrics for one app: a private registry (several apps can live in one process, as in
tests), vLLM-style names with the `dspark:` prefix.

Counters that the engine already counts (tokens, spec-decode drafts) are not double-kept: a custom
collector reads `EngineMetrics` at scrape time, so they are exact. Request-level latencies are
histograms observed when a request ends (the `AsyncEngine.on_request_end` hook, on the engine
thread; prometheus_client metrics are thread-safe). The verify-budget and coalescing histograms
are fed from `EngineMetrics.drain_verify_lens()` / `drain_coalesce_held_steps()` at each request end
and each scrape. τ (mean tokens per verification round) is derived from the counters at scrape
time, and the cost table the length policy is using (live, if online upkeep refreshes it) is one
gauge sample per profiled point.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dspark.server.async_engine import RequestRecord

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                  0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0)
VERIFY_BUDGET_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
COALESCE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)


class _EngineCollector:
    """Reads the engine's counters and gauges at scrape time."""

    def __init__(self, async_engine):
        self.async_engine = async_engine

    def describe(self):
        return []  # no up-front description: register() must not call collect() early

    def collect(self):
        ae = self.async_engine
        m = ae.metrics

        def counter(name: str, doc: str, value: float):
            return CounterMetricFamily(f"dspark:{name}", doc, value=value)

        yield counter("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                      m.num_prompt_tokens)
        yield counter("generation_tokens", "Output tokens produced by the engine.",
                      m.num_generation_tokens)
        yield counter("num_preemptions", "Requests preempted by recompute.", m.num_preemptions)
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
        per_pos = CounterMetricFamily("dspark:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by draft position.",
                                      labels=["position"])
        for pos, value in enumerate(list(m.accepted_per_pos)):
            per_pos.add_metric([str(pos)], value)
        yield per_pos
        tau = 1.0 + m.num_accepted_tokens / m.num_drafts if m.num_drafts else 1.0
        yield GaugeMetricFamily("dspark:spec_decode_mean_acceptance_length",
                                "Mean tokens per verification round with drafts (tau, bonus "
                                "included).", value=tau)
        cost_table = getattr(ae.engine, "cost_table", None)
        if cost_table is not None:
            sps = GaugeMetricFamily("dspark:cost_table_sps",
                                    "Verification steps per second at num_tokens, from the "
                                    "cost table in use.", labels=["num_tokens"])
            for num_tokens, value in zip(cost_table.num_tokens, cost_table.steps_per_second):
                sps.add_metric([str(num_tokens)], value)
            yield sps
        switch = getattr(ae.engine, "switch", None)
        if switch is not None:
            on = GaugeMetricFamily("dspark:measured_switch_on",
                                   "Speculation on (1) or off (0) at a load (requests in a step), as the "
                                   "measured switch decided it.", labels=["load"])
            per_token = GaugeMetricFamily("dspark:measured_switch_seconds_per_token",
                                          "Seconds of an engine decode step per emitted token at a load, "
                                          "with speculation and without (measured switch).",
                                          labels=["load", "mode"])
            for label, is_on, spec, plain in switch.snapshot():
                on.add_metric([label], float(is_on))
                for mode, value in (("speculative", spec), ("plain", plain)):
                    if value is not None:
                        per_token.add_metric([label, mode], value)
            yield on
            yield per_token
        yield GaugeMetricFamily("dspark:kv_cache_usage_perc", "KV-cache usage (1 = full).",
                                value=ae.kv_usage)
        yield GaugeMetricFamily("dspark:num_requests_waiting", "Requests waiting for admission.",
                                value=ae.num_waiting)
        yield GaugeMetricFamily("dspark:num_requests_running", "Requests being scheduled.",
                                value=ae.num_running)
        yield from _reliability_families(ae)


def _reliability_families(ae):
    """Admission refusals, requests failed on their own, and the engine's fault fallbacks."""
    rejected = CounterMetricFamily("dspark:num_requests_rejected",
                                   "Requests refused at admission: 429 past max_num_waiting, 503 "
                                   "while draining.", labels=["status"])
    for status, value in sorted(ae.num_rejected.items()):
        rejected.add_metric([str(status)], value)
    yield rejected
    yield CounterMetricFamily("dspark:num_requests_failed",
                              "Requests ended by their own fault (500) or their deadline (504).",
                              value=ae.num_failed)
    m = ae.metrics
    yield CounterMetricFamily("dspark:spec_decode_num_draft_faults",
                              "Request-steps decoded plainly because the drafter raised or returned "
                              "non-finite or out-of-range drafts.",
                              value=getattr(m, "num_draft_faults", 0))


class ServerMetrics:
    def __init__(self, async_engine):
        self.async_engine = async_engine
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.request_success = Counter("dspark:request_success", "Finished requests.",
                                       ["finish_reason"], registry=r)
        self.ttft_s = Histogram("dspark:time_to_first_token_seconds", "Time to first token.",
                                buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot_s = Histogram("dspark:time_per_output_token_seconds",
                                "Mean time per output token after the first, per request.",
                                buckets=TPOT_BUCKETS_S, registry=r)
        self.e2e_s = Histogram("dspark:e2e_request_latency_seconds", "End-to-end request latency.",
                               buckets=E2E_BUCKETS_S, registry=r)
        self.verify_budget = Histogram("dspark:spec_decode_verify_budget",
                                       "Drafts verified per request per step (verify length).",
                                       buckets=VERIFY_BUDGET_BUCKETS, registry=r)
        self.coalesce_held = Histogram("dspark:coalesce_held_steps",
                                       "Steps a request's prompt was held back by coalescing.",
                                       buckets=COALESCE_BUCKETS, registry=r)
        r.register(_EngineCollector(async_engine))

    def on_request_end(self, record: RequestRecord) -> None:
        self.request_success.labels(finish_reason=record.finish_reason).inc()
        self.e2e_s.observe(record.end_s - record.arrival_s)
        if record.first_token_s is not None:
            self.ttft_s.observe(record.first_token_s - record.arrival_s)
            if record.num_output_tokens > 1:
                self.tpot_s.observe((record.end_s - record.first_token_s)
                                    / (record.num_output_tokens - 1))
        self._drain_verify_lens()

    def _drain_verify_lens(self) -> None:
        m = self.async_engine.metrics
        for verify_len in m.drain_verify_lens():
            self.verify_budget.observe(verify_len)
        for held in m.drain_coalesce_held_steps():
            self.coalesce_held.observe(held)

    def render(self) -> bytes:
        self._drain_verify_lens()
        return generate_latest(self.registry)
