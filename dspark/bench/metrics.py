"""Serving-benchmark metrics from client-side request records and Prometheus counter deltas.

Definitions (vLLM's `benchmark_serving` meanings, computed here from `RequestRecord`s):

- TTFT  = arrival of the first content chunk − send time.
- E2EL  = end of the response stream − send time.
- TPOT  = (E2EL − TTFT) / (output_tokens − 1), per request; requests with one output token are left
          out of TPOT (division by zero).
- ITL   = the gaps between consecutive content chunks, pooled over all requests. A chunk that
          carries several tokens (speculative decoding emits accepted drafts + bonus at once)
          contributes ONE gap, so with speculation ITL measures time between *steps*, not between
          tokens: mean ITL ≈ TPOT × tokens-per-chunk, and ITL and TPOT differ. Compare methods
          with TPOT.
- Duration = first send → last stream end over the measured requests; request / output / total
          token throughput are divided by it. Failed requests count in the duration only.
- `per_user_output_tok_s` = 1000 / mean TPOT in ms (the speed one user sees).

Keys are `vllm bench serve`'s (`duration`, `completed`, `failed`, `request_throughput`,
`output_throughput`, `total_token_throughput`, `max_output_tokens_per_s`, `max_concurrent_requests`,
`request_goodput`, `{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms`, `spec_decode_*`), so a script that
reads vLLM's result JSON reads dspark's; dspark's extras (`num_requests`, `num_chunks`,
`mean_tokens_per_chunk`, `per_user_output_tok_s`, `first_error`, `clock_check`) sit beside them.
Latency statistics are reported in ms as mean, median, std and the requested percentiles
(`numpy.percentile`, linear interpolation); an empty population gives None, never NaN (the output must
stay valid JSON). Goodput (vLLM's `--goodput ttft:500 tpot:50`): completed requests per second whose
every named latency (ms) is at most its bound.

Speculation (`spec_decode_stats`): deltas of the server's Prometheus counters
`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos{position=...}` between a scrape before and one after the run,
summed over all other labels, under vLLM's result keys:
  spec_decode_num_drafts, spec_decode_draft_tokens, spec_decode_accepted_tokens
  spec_decode_acceptance_length = 1 + accepted / drafts   (tokens per verify step, bonus included)
  spec_decode_acceptance_rate   = 100 * accepted / draft_tokens   (percent, as vLLM)
  spec_decode_per_position_acceptance_rates[k] = accepted_at_position_k / drafts
  spec_decode_mean_verify_budget = Δsum / Δcount of the `..._spec_decode_verify_budget` histogram
                      (dspark: drafts verified per request per step, as the length policy chose them)
Missing counters give no stats (None), not an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.bench.client import RequestRecord

PERCENTILES = (90, 99)
LATENCY_NAMES = ("ttft", "tpot", "itl", "e2el")
SPEC_PREFIXES = ("vllm:",)
_SPEC_TOTALS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens")
_SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
_VERIFY_BUDGET = "spec_decode_verify_budget"  # histogram: _sum and _count samples


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one successful request."""

    ttft_s: float
    e2el_s: float
    tpot_s: float | None  # None when the request produced fewer than 2 tokens
    itl_s: tuple[float, ...]  # one gap per pair of consecutive content chunks
    num_output_tokens: int


@dataclass(frozen=True)
class SpecCounters:
    """Speculative-decoding counter values from one /metrics scrape."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    num_accepted_tokens_per_pos: dict[int, float]
    verify_budget_sum: float = 0.0  # histogram `spec_decode_verify_budget` sum of verify lengths
    verify_budget_count: float = 0.0  # ... and number of (request, step) observations


def request_metrics(record: RequestRecord) -> RequestMetrics | None:
    """TTFT / E2EL / TPOT / ITL of one request; None if it failed or streamed no content."""
    if not record.success or not record.chunk_arrival_s:
        return None
    ttft_s = record.chunk_arrival_s[0] - record.send_s
    e2el_s = record.end_s - record.send_s
    n = record.num_output_tokens
    tpot_s = (e2el_s - ttft_s) / (n - 1) if n > 1 else None
    itl_s = tuple(float(g) for g in np.diff(record.chunk_arrival_s))
    return RequestMetrics(ttft_s, e2el_s, tpot_s, itl_s, n)


def _pct_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def latency_stats_ms(name: str, values_s: list[float],
                     percentiles=PERCENTILES) -> dict[str, float | None]:
    """`{mean,median,std,pNN}_<name>_ms` of `values_s` (given in seconds)."""
    keys = ["mean", "median", "std"] + [_pct_name(p) for p in percentiles]
    if not values_s:
        return {f"{k}_{name}_ms": None for k in keys}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    values = [ms.mean(), np.median(ms), ms.std()] + [np.percentile(ms, p) for p in percentiles]
    return {f"{k}_{name}_ms": float(v) for k, v in zip(keys, values)}


def parse_goodput(items) -> dict[str, float]:
    """vLLM's `--goodput KEY:VALUE ...` (ttft, tpot, e2el in ms) → {name: bound_ms}."""
    out = {}
    for item in items or ():
        key, _, value = str(item).partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        out[key] = float(value)
    return out


def _max_concurrent(records) -> int:
    events = sorted([(r.send_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    running = best = 0
    for _, delta in events:
        running += delta
        best = max(best, running)
    return best


def _max_tokens_per_s(records) -> float:
    """The most output tokens that arrived within one whole second of the run (vLLM's peak)."""
    per_second: dict[int, int] = {}
    for r in records:
        for t, n in zip(r.chunk_arrival_s, r.chunk_num_tokens):
            per_second[int(t)] = per_second.get(int(t), 0) + n
    return float(max(per_second.values(), default=0))


def compute_metrics(records: list[RequestRecord] | tuple[RequestRecord, ...],
                    wall_time_s: float | None = None, *, percentiles=PERCENTILES,
                    goodput: dict[str, float] | None = None) -> dict:
    """Aggregate metrics of a run (flat dict, JSON-ready, vLLM's keys), plus the `clock_check` sub-dict."""
    per_request = [m for m in (request_metrics(r) for r in records) if m is not None]
    ok = [r for r in records if r.success and r.chunk_arrival_s]
    duration_s = (max(r.end_s for r in records) - min(r.send_s for r in records)
                  if records else 0.0)
    total_output = sum(r.num_output_tokens for r in ok)
    total_input = sum(r.num_prompt_tokens or 0 for r in ok)
    num_chunks = sum(len(r.chunk_arrival_s) for r in ok)
    counted_output = sum(sum(r.chunk_num_tokens) for r in ok)

    def per_s(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    out: dict = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "max_output_tokens_per_s": _max_tokens_per_s(ok),
        "max_concurrent_requests": _max_concurrent(records),
        "num_chunks": num_chunks,
        "mean_tokens_per_chunk": counted_output / num_chunks if num_chunks else None,
    }
    if goodput:
        good = [m for m in per_request if all(
            (value := {"ttft": m.ttft_s, "tpot": m.tpot_s, "e2el": m.e2el_s}[k]) is None or value * 1000 <= bound
            for k, bound in goodput.items())]
        out["request_goodput"] = per_s(len(good))
    out |= latency_stats_ms("ttft", [m.ttft_s for m in per_request], percentiles)
    out |= latency_stats_ms("tpot", [m.tpot_s for m in per_request if m.tpot_s is not None], percentiles)
    out |= latency_stats_ms("itl", [g for m in per_request for g in m.itl_s], percentiles)
    out |= latency_stats_ms("e2el", [m.e2el_s for m in per_request], percentiles)
    mean_tpot_ms = out["mean_tpot_ms"]
    out["per_user_output_tok_s"] = 1000.0 / mean_tpot_ms if mean_tpot_ms else None
    errors = [r.error for r in records if r.error]
    out["first_error"] = errors[0] if errors else None
    if wall_time_s is not None:
        out["clock_check"] = clock_check(wall_time_s, duration_s, out["output_throughput"],
                                         counted_output)
    return out


def clock_check(wall_time_s: float, duration_s: float, output_throughput_tok_s: float,
                counted_output_tokens: int) -> dict:
    """Independent-clock check: perf_counter wall time × measured throughput vs tokens counted
    chunk by chunk. A relative error far from 0 means the timestamps or token counts are off."""
    wall_tokens = wall_time_s * output_throughput_tok_s
    rel = (wall_tokens / counted_output_tokens - 1.0) if counted_output_tokens else None
    return {
        "wall_time_s": wall_time_s,
        "duration_s": duration_s,
        "wall_time_x_output_throughput_tokens": wall_tokens,
        "counted_output_tokens": counted_output_tokens,
        "relative_error": rel,
    }


def parse_spec_counters(text: str | None) -> SpecCounters | None:
    """Speculation counters from Prometheus exposition text; None if none are present.

    The first prefix of `SPEC_PREFIXES` with any spec counter wins; samples are summed over labels
    (per position for the per-position counter); `_created` samples are ignored."""
    if not text:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    per_pos: dict[str, dict[int, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.endswith("_created"):
                continue
            name = name.removesuffix("_total")
            if name.split(":", 1)[-1] == _SPEC_PER_POS and "position" in sample.labels:
                pos = int(sample.labels["position"])
                by_pos = per_pos.setdefault(name, {})
                by_pos[pos] = by_pos.get(pos, 0.0) + float(sample.value)
            else:
                sums[name] = sums.get(name, 0.0) + float(sample.value)
    for prefix in SPEC_PREFIXES:
        names = [prefix + n for n in _SPEC_TOTALS]
        if any(n in sums for n in names) or prefix + _SPEC_PER_POS in per_pos:
            return SpecCounters(*(sums.get(n, 0.0) for n in names),
                                num_accepted_tokens_per_pos=per_pos.get(prefix + _SPEC_PER_POS, {}),
                                verify_budget_sum=sums.get(prefix + _VERIFY_BUDGET + "_sum", 0.0),
                                verify_budget_count=sums.get(prefix + _VERIFY_BUDGET + "_count",
                                                             0.0))
    return None


def spec_decode_stats(before_text: str | None, after_text: str | None) -> dict | None:
    """Acceptance statistics from two /metrics scrapes; None when the counters are unavailable.

    A counter absent before the run (created lazily by the server) counts as 0 there; if the
    first scrape failed outright the delta is unknown and None is returned."""
    after = parse_spec_counters(after_text)
    if after is None or before_text is None:
        return None
    before = parse_spec_counters(before_text) or SpecCounters(0.0, 0.0, 0.0, {})
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    stats: dict = {"spec_decode_num_drafts": drafts, "spec_decode_draft_tokens": draft_tokens,
                   "spec_decode_accepted_tokens": accepted}
    if drafts > 0:
        stats["spec_decode_acceptance_length"] = 1.0 + accepted / drafts
        positions = sorted(after.num_accepted_tokens_per_pos)
        if positions:
            stats["spec_decode_per_position_acceptance_rates"] = [
                (after.num_accepted_tokens_per_pos.get(p, 0.0)
                 - before.num_accepted_tokens_per_pos.get(p, 0.0)) / drafts
                for p in range(positions[-1] + 1)
            ]
    if draft_tokens > 0:
        stats["spec_decode_acceptance_rate"] = 100.0 * accepted / draft_tokens
    budget_count = after.verify_budget_count - before.verify_budget_count
    if budget_count > 0:
        stats["spec_decode_num_verify_budget_samples"] = budget_count
        stats["spec_decode_mean_verify_budget"] = (after.verify_budget_sum
                                                   - before.verify_budget_sum) / budget_count
    return stats
