"""Serving-benchmark metric computations against hand-computed traces, Prometheus delta parsing,
and the report helpers. Run: pytest tests/test_bench_metrics.py -q"""

import json
import math

import pytest

from dspark.bench.client import RequestRecord
from dspark.bench.metrics import (compute_metrics, latency_stats_ms, parse_spec_counters,
                                  request_metrics, spec_decode_stats)
from dspark.bench.report import (markdown_table, pareto_front, plot_throughput_curves,
                                 summary_json_line)


def _record(i, send_s, chunks_s, tokens, end_s, prompt_tokens=None, error="", usage=True):
    return RequestRecord(
        request_index=i, prompt_source="t", send_s=send_s, end_s=end_s,
        chunk_arrival_s=tuple(chunks_s), chunk_num_tokens=tuple(tokens),
        num_prompt_tokens=prompt_tokens, num_output_tokens=sum(tokens),
        usage_reported=usage, finish_reason=None if error else "length", error=error)


# A: 3 chunks carrying 1, 3, 2 tokens (speculation): TTFT 0.1, E2EL 0.5, TPOT 0.4/5 = 0.08,
#    ITL gaps 0.1 and 0.3 (mean 0.2 != TPOT: one gap per chunk, not per token).
# B: a single 1-token chunk: TTFT 0.2, E2EL 0.25, no TPOT, no ITL.
# C: failed; counts only in the duration.
TRACE = [
    _record(0, 0.0, [0.1, 0.2, 0.5], [1, 3, 2], 0.5, prompt_tokens=10),
    _record(1, 1.0, [1.2], [1], 1.25, prompt_tokens=20),
    _record(2, 0.5, [], [], 0.6, error="HTTP 500: boom"),
]


def test_request_metrics_multi_token_chunks():
    m = request_metrics(TRACE[0])
    assert m.ttft_s == pytest.approx(0.1)
    assert m.e2el_s == pytest.approx(0.5)
    assert m.tpot_s == pytest.approx(0.08)
    assert m.itl_s == pytest.approx((0.1, 0.3))
    assert sum(m.itl_s) / len(m.itl_s) != pytest.approx(m.tpot_s), "ITL must differ from TPOT here"
    one = request_metrics(TRACE[1])
    assert one.tpot_s is None and one.itl_s == ()
    assert request_metrics(TRACE[2]) is None


def test_compute_metrics_aggregate():
    out = compute_metrics(TRACE, wall_time_s=1.3)
    assert (out["num_requests"], out["completed"], out["failed"]) == (3, 2, 1)
    assert out["duration"] == pytest.approx(1.25)  # first send 0.0 -> last end 1.25
    assert out["total_output_tokens"] == 7 and out["total_input_tokens"] == 30
    assert out["request_throughput"] == pytest.approx(2 / 1.25)
    assert out["output_throughput"] == pytest.approx(7 / 1.25)
    assert out["total_token_throughput"] == pytest.approx(37 / 1.25)
    assert out["max_concurrent_requests"] == 1  # A (0.0-0.5) ends as C (0.5-0.6) starts; B (1.0-1.25) alone
    assert out["max_output_tokens_per_s"] == 6  # A's 6 tokens all arrive in second 0
    assert out["mean_ttft_ms"] == pytest.approx(150.0)
    assert out["median_ttft_ms"] == pytest.approx(150.0)
    assert out["p90_ttft_ms"] == pytest.approx(190.0)  # linear interpolation 100 -> 200
    assert out["p99_ttft_ms"] == pytest.approx(199.0)
    assert out["mean_tpot_ms"] == pytest.approx(80.0) and out["p99_tpot_ms"] == pytest.approx(80.0)
    assert out["mean_itl_ms"] == pytest.approx(200.0)
    assert out["p90_itl_ms"] == pytest.approx(280.0)
    assert out["mean_e2el_ms"] == pytest.approx(375.0)
    assert out["mean_tokens_per_chunk"] == pytest.approx(7 / 4)
    assert out["per_user_output_tok_s"] == pytest.approx(12.5)
    assert out["first_error"] == "HTTP 500: boom"
    clock = out["clock_check"]
    assert clock["wall_time_x_output_throughput_tokens"] == pytest.approx(1.3 * 7 / 1.25)
    assert clock["counted_output_tokens"] == 7
    assert clock["relative_error"] == pytest.approx(1.3 / 1.25 - 1)


def test_compute_metrics_empty_is_json_safe():
    out = compute_metrics([], wall_time_s=0.0)
    assert out["num_requests"] == 0 and out["mean_ttft_ms"] is None
    json.loads(summary_json_line(out))


def test_percentiles():
    stats = latency_stats_ms("x", [i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats["mean_x_ms"] == pytest.approx(50.5)
    assert stats["median_x_ms"] == pytest.approx(50.5)
    assert stats["p90_x_ms"] == pytest.approx(90.1)
    assert stats["p99_x_ms"] == pytest.approx(99.01)
    assert stats["std_x_ms"] == pytest.approx(math.sqrt((100**2 - 1) / 12))
    assert all(v is None for v in latency_stats_ms("x", []).values())


def _exposition(prefix, drafts, draft_tokens, accepted, per_pos, engines=("0",)):
    lines = []
    for name, value in (("num_drafts", drafts), ("num_draft_tokens", draft_tokens),
                        ("num_accepted_tokens", accepted)):
        lines += [f"# HELP {prefix}spec_decode_{name} help text",
                  f"# TYPE {prefix}spec_decode_{name} counter"]
        for e in engines:  # split across engines: the parser must sum over labels
            lines.append(f'{prefix}spec_decode_{name}_total{{engine="{e}",model_name="m"}} '
                         f"{value / len(engines)}")
            lines.append(f'{prefix}spec_decode_{name}_created{{engine="{e}",model_name="m"}} 1.7e9')
    lines.append(f"# TYPE {prefix}spec_decode_num_accepted_tokens_per_pos counter")
    for pos, value in enumerate(per_pos):
        lines.append(f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}} '
                     f"{value}")
    lines += ["# TYPE process_cpu_seconds counter", "process_cpu_seconds_total 12.5"]
    return "\n".join(lines) + "\n"


def test_prometheus_parse_sums_labels_and_ignores_created():
    c = parse_spec_counters(_exposition("vllm:", 10, 40, 15, [8, 5, 2], engines=("0", "1")))
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (10, 40, 15)
    assert c.num_accepted_tokens_per_pos == {0: 8, 1: 5, 2: 2}
    assert parse_spec_counters("# TYPE foo counter\nfoo_total 3\n") is None
    assert parse_spec_counters(None) is None


def test_spec_decode_stats_from_deltas():
    before = _exposition("vllm:", 5, 20, 7, [4, 2, 1])
    after = _exposition("vllm:", 15, 60, 22, [12, 7, 3])
    s = spec_decode_stats(before, after)  # delta: 10 drafts, 40 draft tokens, 15 accepted
    assert (s["spec_decode_num_drafts"], s["spec_decode_draft_tokens"], s["spec_decode_accepted_tokens"]) == (
        10, 40, 15)
    assert s["spec_decode_acceptance_length"] == pytest.approx(2.5)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(37.5)  # percent, as vLLM
    assert s["spec_decode_per_position_acceptance_rates"] == pytest.approx([0.8, 0.5, 0.2])


def test_spec_decode_stats_missing_or_lazy_counters():
    after = _exposition("vllm:", 10, 40, 15, [8, 5, 2])
    no_spec = ("process_cpu_seconds_total 1\n", "process_cpu_seconds_total 2\n")
    assert spec_decode_stats(*no_spec) is None
    assert spec_decode_stats(None, after) is None  # no baseline: delta unknown
    lazy = spec_decode_stats("process_cpu_seconds_total 1\n", after)  # created after the scrape
    assert lazy["spec_decode_acceptance_length"] == pytest.approx(2.5)
    zero = spec_decode_stats(after, after)  # a server without speculation traffic
    assert zero["spec_decode_num_drafts"] == 0 and "spec_decode_acceptance_length" not in zero


def test_pareto_front():
    points = [(1, 10), (2, 9), (2, 5), (3, 3), (1.5, 4), (3, 3), (0.5, 10)]
    assert pareto_front(points) == [(1, 10), (2, 9), (3, 3)]
    assert pareto_front([]) == []


def test_summary_json_line_and_markdown(tmp_path):
    result = {"label": "dspark", "request_rate": math.inf, "mean_tpot_ms": 12.345,
              "output_throughput": 1000.0, "per_user_output_tok_s": 81.0,
              "requests": [{"big": 1}], "nan": math.nan}
    line = summary_json_line(result)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["request_rate"] == "inf" and parsed["nan"] is None and "requests" not in parsed
    table = markdown_table([result, {"label": "eagle"}], ["label", ("mean_tpot_ms", "TPOT (ms)")])
    assert table.splitlines() == ["| label | TPOT (ms) |", "|---|---:|",
                                  "| dspark | 12.35 |", "| eagle | - |"]
    runs = [dict(result, output_throughput=x, per_user_output_tok_s=y, label=m)
            for m, x, y in (("a", 100, 50), ("a", 300, 30), ("a", 200, 20), ("b", 150, 60))]
    png = plot_throughput_curves(runs, tmp_path / "curves.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
