"""Tables and plots of a `dspark bench sweep`: repeats averaged into one row per (dataset, method,
concurrency), `report.md` with one markdown table per dataset, and four kinds of PNG:

- `pareto_<dataset>.png`: per-user tok/s (1000 / mean TPOT) against total output tok/s, one curve
  (its Pareto front) per method (`report.plot_throughput_curves`);
- `tpot_vs_concurrency.png`: mean TPOT against concurrency, one panel per dataset;
- `tau_by_dataset.png`: τ (mean acceptance length, bonus included) per dataset, one bar per
  speculative method, averaged over concurrencies;
- `verify_budget_vs_concurrency.png`: mean drafts verified per request per step against
  concurrency, one panel per dataset.
Not run directly: `dspark bench sweep` calls `write_report(points, out_dir)`; re-plot a finished
sweep with `python -m dspark.bench.sweep_report OUT_DIR` (last stdout line: JSON of the files).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from dspark.bench.report import markdown_table, plot_throughput_curves

ROW_KEYS = ("mean_tpot_ms", "mean_ttft_ms", "output_throughput_tok_s", "per_user_output_tok_s",
            "tau", "mean_verify_budget", "acceptance_rate", "num_completed", "num_failed")
TABLE_COLUMNS = (("method", "method"), ("max_concurrency", "concurrency"),
                 ("mean_tpot_ms", "TPOT mean (ms)"), ("output_throughput_tok_s", "total out tok/s"),
                 ("output_throughput_tok_s_std", "± std"),
                 ("per_user_output_tok_s", "per-user tok/s"), ("tau", "τ"),
                 ("mean_verify_budget", "verify budget"), ("mean_ttft_ms", "TTFT mean (ms)"),
                 ("num_repeats", "repeats"))


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def aggregate(points: list[dict]) -> list[dict]:
    """One row per (dataset, method, concurrency): the mean of each `ROW_KEYS` metric over the
    repeats that succeeded, plus `output_throughput_tok_s_std` and `num_repeats`. Rows keep the
    order in which their first point appears."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        if not p.get("error"):
            groups.setdefault((p["dataset"], p["method"], p["max_concurrency"]), []).append(p)
    rows = []
    for (dataset, method, concurrency), group in groups.items():
        row = {"dataset": dataset, "method": method, "max_concurrency": concurrency,
               "label": method, "num_repeats": len(group)}
        for key in ROW_KEYS:
            row[key] = _mean([p.get(key) for p in group])
        tput = [p["output_throughput_tok_s"] for p in group]
        row["output_throughput_tok_s_std"] = statistics.stdev(tput) if len(tput) > 1 else None
        rows.append(row)
    return rows


def safe_name(text: str) -> str:
    """A dataset name or path → a file-name fragment."""
    stem = Path(text).stem if text.endswith(".jsonl") else text
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) or "dataset"


def markdown_report(rows: list[dict], *, header: str = "", skipped: dict | None = None) -> str:
    """`report.md`: a header, one table per dataset (methods × concurrency), skipped methods."""
    parts = [header.rstrip(), ""] if header else []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        ds_rows = [r for r in rows if r["dataset"] == dataset]
        parts += [f"## {dataset}", "", markdown_table(ds_rows, TABLE_COLUMNS),
                  "", f"![Pareto]({'pareto_' + safe_name(dataset)}.png)", ""]
    parts += ["## Plots", "", "![TPOT](tpot_vs_concurrency.png)", "", "![tau](tau_by_dataset.png)",
              "", "![verify budget](verify_budget_vs_concurrency.png)", ""]
    if skipped:
        parts += ["## Skipped methods", ""]
        parts += [f"- `{m}`: {why}" for m, why in skipped.items()] + [""]
    return "\n".join(parts)


def _panels(plt, num: int):
    fig, axes = plt.subplots(1, max(num, 1), figsize=(5 * max(num, 1), 4), squeeze=False)
    return fig, list(axes[0])


def _lines_by_concurrency(rows: list[dict], key: str, ylabel: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = _panels(plt, len(datasets))
    for ax, dataset in zip(axes, datasets or [""]):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["max_concurrency"], r[key]) for r in rows
                         if r["dataset"] == dataset and r["method"] == method
                         and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(dataset)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tau_bars(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows)
               if any(r.get("tau") is not None for r in rows if r["method"] == m)]
    fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(datasets) * max(len(methods), 1)), 4))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        taus = [_mean([r.get("tau") for r in rows if r["dataset"] == d and r["method"] == method])
                for d in datasets]
        ax.bar([j + i * width for j in range(len(datasets))], [t or 0.0 for t in taus], width,
               label=method)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(datasets))], datasets)
    ax.set_ylabel("τ (tokens per verify step, bonus incl.)")
    ax.axhline(1.0, color="gray", lw=0.8)
    if methods:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no speculative method", ha="center", va="center",
                transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_header(results: dict) -> str:
    """The top of report.md from a results.json dict: model, command, date, machine, settings."""
    cfg = results.get("config", {})
    lines = [f"# Serving sweep: {results.get('model', '?')}", "",
             f"- command: `{results.get('command', '?')}`",
             f"- date: {results.get('date', '?')}", f"- machine: {results.get('machine', '?')}",
             f"- prompts per point: {cfg.get('num_prompts')}, max tokens: {cfg.get('max_tokens')}, "
             f"ignore EOS: {cfg.get('ignore_eos')}, repeats: {cfg.get('repeats')}, "
             f"temperature: {cfg.get('temperature')}",
             "- TPOT, TTFT, throughput: client side (`dspark bench serve` definitions); "
             "τ and verify budget: server /metrics deltas; rows are means over repeats.", ""]
    return "\n".join(lines)


def write_report(points: list[dict], out_dir: str | Path, *, header: str = "",
                 skipped: dict | None = None) -> dict:
    """Write report.md and the PNGs into `out_dir`; returns {"rows": ..., "files": [...]}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = aggregate(points)
    files = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        ds_rows = [r for r in rows if r["dataset"] == dataset]
        files.append(plot_throughput_curves(ds_rows, out_dir / f"pareto_{safe_name(dataset)}.png",
                                            title=dataset))
    files.append(_lines_by_concurrency(rows, "mean_tpot_ms", "mean TPOT (ms)",
                                       out_dir / "tpot_vs_concurrency.png"))
    files.append(_tau_bars(rows, out_dir / "tau_by_dataset.png"))
    files.append(_lines_by_concurrency(rows, "mean_verify_budget",
                                       "verify budget (drafts / request / step)",
                                       out_dir / "verify_budget_vs_concurrency.png"))
    report = out_dir / "report.md"
    report.write_text(markdown_report(rows, header=header, skipped=skipped))
    files.append(report)
    return {"rows": rows, "files": [str(f) for f in files]}


def main(argv: list[str] | None = None) -> int:
    out_dir = Path((argv or sys.argv[1:])[0])
    data = json.loads((out_dir / "results.json").read_text())
    written = write_report(data["points"], out_dir, header=report_header(data),
                           skipped=data.get("skipped"))
    print(json.dumps({"files": written["files"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
