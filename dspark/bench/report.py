"""Reporting for the benchmarks: the human summary, the JSON line, result files, and reusable
helpers for sweeps (`pareto_front`, `plot_throughput_curves`, `markdown_table`).

Output contract of `dspark bench serve`: `print_report` prints the summary table, then as the LAST
stdout line one JSON object with every aggregate metric (no per-request records; those go to the
`--result-file`). Non-finite floats are written as the string "inf"/"-inf" or null, so the line is
strict JSON.

Example (a sweep script, after collecting `run_bench` results with `label` set per method):
    from dspark.bench.report import plot_throughput_curves, markdown_table
    plot_throughput_curves(results, "sweep.png")
    print(markdown_table(results, ["label", "max_concurrency", "output_throughput_tok_s"]))
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

_LATENCY_ROWS = (("ttft", "Time to first token"), ("tpot", "Time per output token (excl. 1st)"),
                 ("itl", "Inter-chunk latency"), ("e2el", "End-to-end latency"))


def latency_summary(ttft_s: list[float], tpot_s: list[float]) -> dict:
    """Medians over prompts; TPOT also as decode tok/s."""
    ttft = statistics.median(ttft_s) * 1000 if ttft_s else None
    tpot = statistics.median(tpot_s) * 1000 if tpot_s else None
    return {"median_ttft_ms": ttft, "median_tpot_ms": tpot,
            "decode_tok_s": 1000.0 / tpot if tpot else None}


def json_safe(value):
    """A copy of `value` with inf → "inf"/"-inf" and NaN → None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def summary_json_line(result: dict) -> str:
    """One-line strict JSON of the aggregate result (per-request `requests` left out)."""
    aggregate = {k: v for k, v in result.items() if k != "requests"}
    return json.dumps(json_safe(aggregate), allow_nan=False, separators=(",", ":"))


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_summary(result: dict) -> str:
    """A fixed-width human summary of one `run_bench` result."""
    width = 60
    lines = ["=" * width, " Serving benchmark ".center(width, "=")]

    def row(name: str, value, digits: int = 2) -> None:
        lines.append(f"{name:<44}{_fmt(value, digits):>16}")

    for key, name in (("label", "Label"), ("model", "Model"), ("endpoint", "Endpoint"),
                      ("dataset", "Dataset")):
        if result.get(key):
            lines.append(f"{name:<20}{str(result[key]):>40}")
    row("Requests completed / failed",
        f"{result.get('completed')} / {result.get('failed')}")
    row("Max concurrency", result.get("max_concurrency") or "unbounded")
    row("Request rate (req/s)", result.get("request_rate"))
    row("Benchmark duration (s)", result.get("duration"))
    row("Total input tokens", result.get("total_input_tokens"))
    row("Total output tokens", result.get("total_output_tokens"))
    row("Request throughput (req/s)", result.get("request_throughput"))
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s)", result.get("request_goodput"))
    row("Output token throughput (tok/s)", result.get("output_throughput"))
    row("Peak output token throughput (tok/s)", result.get("max_output_tokens_per_s"))
    row("Total token throughput (tok/s)", result.get("total_token_throughput"))
    row("Per-user output speed (tok/s, 1000/TPOT)", result.get("per_user_output_tok_s"))
    row("Mean tokens per stream chunk", result.get("mean_tokens_per_chunk"))
    for key, name in _LATENCY_ROWS:
        lines.append(f" {name} ".center(width, "-"))
        stats = [k[: -len(f"_{key}_ms")] for k in result if k.endswith(f"_{key}_ms")]
        for stat in stats:
            row(f"{stat.capitalize()} {key.upper()} (ms)", result.get(f"{stat}_{key}_ms"))
    lines.append(" Speculative decoding (server /metrics) ".center(width, "-"))
    if "spec_decode_num_drafts" in result:
        row("Drafts / draft tokens / accepted",
            f"{result['spec_decode_num_drafts']:.0f} / {result['spec_decode_draft_tokens']:.0f} / "
            f"{result['spec_decode_accepted_tokens']:.0f}")
        row("Acceptance length (incl. bonus)", result.get("spec_decode_acceptance_length"), 3)
        row("Acceptance rate (%)", result.get("spec_decode_acceptance_rate"), 2)
        row("Mean verify budget (drafts/request/step)", result.get("spec_decode_mean_verify_budget"), 3)
        per_pos = result.get("spec_decode_per_position_acceptance_rates")
        if per_pos:
            lines.append("Per-position acceptance: " + " ".join(f"{r:.2f}" for r in per_pos))
    else:
        lines.append("(no spec_decode counters on /metrics)")
    clock = result.get("clock_check")
    if clock:
        lines.append(" Independent clock check ".center(width, "-"))
        row("Wall time (s, perf_counter)", clock["wall_time_s"], 3)
        row("Wall time x output throughput (tok)", clock["wall_time_x_output_throughput_tokens"], 1)
        row("Output tokens counted from chunks", clock["counted_output_tokens"])
        row("Relative error", clock["relative_error"], 4)
    if result.get("first_error"):
        lines.append(f"First error: {result['first_error'][:200]}")
    lines.append("=" * width)
    return "\n".join(lines)


def print_report(result: dict, file: TextIO | None = None) -> None:
    """Print the summary table, then the JSON line, which is the last line written."""
    out = file or sys.stdout
    print(format_summary(result), file=out)
    print(summary_json_line(result), file=out, flush=True)


def write_result_file(path: str | Path, result: dict) -> None:
    """Write the full result (per-request records included) as indented strict JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")


def run_info(argv: Sequence[str] | None = None) -> dict:
    """`command`, `date` (UTC, ISO 8601) and `machine` (platform, CPU count, torch threads, GPU)
    for a result file, so `benchmarks/make_board.py` can say how each figure was produced."""
    import datetime
    import os
    import platform
    import shlex

    args = list(sys.argv if argv is None else argv)
    if args and args[0].endswith(("/dspark", "dspark/__main__.py")):
        args[0] = "dspark"
    machine = f"{platform.platform()}, {platform.processor() or platform.machine()}, " \
              f"{os.cpu_count()} CPUs"
    try:
        import torch

        machine += f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
        if torch.cuda.is_available():
            machine += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"command": shlex.join(args), "date": now.isoformat(timespec="seconds"),
            "machine": machine}


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points not dominated when both coordinates are maximised, sorted by x ascending
    (so y descends along the front). Ties and duplicates are kept once."""
    front: list[tuple[float, float]] = []
    best_y = -math.inf
    for x, y in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if y > best_y:
            front.append((x, y))
            best_y = y
    return front[::-1]


def throughput_point(result: dict) -> tuple[float, float] | None:
    """(total output tok/s, per-user tok/s = 1000 / mean TPOT ms) of one result, if defined."""
    x = result.get("output_throughput", result.get("output_throughput_tok_s"))  # a run, or a sweep point
    y = result.get("per_user_output_tok_s")
    if x is None or y is None:
        return None
    return float(x), float(y)


def plot_throughput_curves(results: Sequence[dict], path: str | Path, label_key: str = "label",
                           title: str | None = None) -> Path:
    """Save a PNG of per-user tok/s (y) against total output tok/s (x), one curve per method.

    Points come from `throughput_point`; a method is `result[label_key]` (results with the same
    label form one curve, joined in order of total throughput). Each method's Pareto front is
    drawn as the line; dominated points are shown as hollow markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[tuple[float, float]]] = {}
    for result in results:
        point = throughput_point(result)
        if point is not None:
            by_method.setdefault(str(result.get(label_key) or "?"), []).append(point)
    fig, ax = plt.subplots(figsize=(7, 5))
    for method, points in by_method.items():
        front = pareto_front(points)
        (line,) = ax.plot([p[0] for p in front], [p[1] for p in front], "o-", label=method)
        dominated = [p for p in points if p not in front]
        if dominated:
            ax.plot([p[0] for p in dominated], [p[1] for p in dominated], "o",
                    mfc="none", color=line.get_color())
    ax.set_xlabel("total output throughput (tok/s)")
    ax.set_ylabel("per-user output speed (tok/s, 1000 / mean TPOT)")
    ax.grid(True, alpha=0.3)
    if by_method:
        ax.legend()
    if title:
        ax.set_title(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_table(rows: Sequence[dict], columns: Sequence[str | tuple[str, str]],
                   digits: int = 2) -> str:
    """A GitHub markdown table of `rows`; a column is a key or a (key, header) pair.
    Floats are rounded to `digits`; missing values print as "-"."""
    keys = [c if isinstance(c, str) else c[0] for c in columns]
    headers = [c if isinstance(c, str) else c[1] for c in columns]
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if _is_numeric_column(rows, k) else "---" for k in keys) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k), digits) for k in keys) + " |")
    return "\n".join(lines)


def _is_numeric_column(rows: Sequence[dict], key: str) -> bool:
    values = [r.get(key) for r in rows if r.get(key) is not None]
    return bool(values) and all(isinstance(v, (int, float)) for v in values)
