"""Generate the benchmark board, benchmarks/board.md (git-ignored: generated on demand, not committed), from
the JSON results under benchmarks/results/ (searched recursively, in path order).

    python benchmarks/make_board.py [--results-dir benchmarks/results] [--out benchmarks/board.md]

Only the text between the lines `<!-- board:start -->` and `<!-- board:end -->` (each alone on its
line) is rewritten; hand-written notes before and after them are kept byte for byte (a file without markers gets them
appended; a missing file is created). Each result file becomes one section: its command, date and
machine (top-level keys, or inside "summary"), then its figures:
- `"bench": "serve_sweep"` (results.json of `dspark bench sweep`): a table per dataset, method ×
  concurrency (TPOT, throughput, per-user tok/s, τ, verify budget);
- `"bench": "offline"` (`dspark bench offline --out`): batch throughput and batch-1 latency tables;
- anything else: every scalar of "summary" (or of the top level), nested keys dotted.
A JSON file with none of command, date and machine (e.g. a sweep's raw/ per-point files) is not a
result and is left out. The output depends only on the files, so a rerun changes nothing.
The last stdout line is JSON: {"out", "num_results", "ignored"}.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dspark.bench.report import markdown_table  # noqa: E402

START, END = "<!-- board:start -->", "<!-- board:end -->"
META_KEYS = ("command", "date", "machine")
SKELETON = ("# Benchmark board\n\nEvery result file under benchmarks/results/, generated; the figures with their "
            "reading are in docs/benchmarks.md. Hand-written notes go outside the board markers; "
            "`python benchmarks/make_board.py` rewrites only the board.\n\n")
SWEEP_COLUMNS = (("method", "method"), ("max_concurrency", "concurrency"),
                 ("mean_tpot_ms", "TPOT mean (ms)"), ("output_throughput_tok_s", "total out tok/s"),
                 ("per_user_output_tok_s", "per-user tok/s"), ("tau", "τ"),
                 ("mean_verify_budget", "verify budget"), ("num_repeats", "repeats"))
OFFLINE_THROUGHPUT = (("batch_size", "batch size"), ("num_prompts", "prompts"),
                      ("total_output_tokens", "output tokens"),
                      ("batch_output_tok_s", "total out tok/s"))
OFFLINE_BATCH1 = (("engine", "engine (batch 1)"), ("median_ttft_ms", "TTFT median (ms)"),
                  ("median_tpot_ms", "TPOT median (ms)"), ("decode_tok_s", "decode tok/s"),
                  ("tau", "τ"))


def result_meta(data: dict) -> dict:
    """command / date / machine from the top level, else from "summary"."""
    summary = data.get("summary") if isinstance(data.get("summary"), dict) else {}
    return {k: data.get(k, summary.get(k)) for k in META_KEYS}


def flatten(value, prefix: str = "") -> list[tuple[str, object]]:
    """Scalar leaves of nested dicts as (dotted key, value); lists are left out."""
    if isinstance(value, dict):
        return [item for k, v in value.items()
                for item in flatten(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return [(prefix, value)]
    return []


def render_sweep(data: dict) -> list[str]:
    rows = data.get("table") or []
    parts = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        parts += [f"**{dataset}**", "",
                  markdown_table([r for r in rows if r["dataset"] == dataset], SWEEP_COLUMNS), ""]
    for method, why in (data.get("skipped") or {}).items():
        parts.append(f"- skipped `{method}`: {why.splitlines()[0] if why else ''}")
    return parts or ["(no points)"]


def render_offline(data: dict) -> list[str]:
    batch1 = [{"engine": name, **row} for name, row in (data.get("batch1") or {}).items()]
    parts = [markdown_table(data.get("throughput") or [], OFFLINE_THROUGHPUT), "",
             markdown_table(batch1, OFFLINE_BATCH1), ""]
    for peer, why in (data.get("skipped_peers") or {}).items():
        parts.append(f"- skipped `{peer}`: {why}")
    return parts


def render_generic(data: dict) -> list[str]:
    source = data["summary"] if isinstance(data.get("summary"), dict) else data
    rows = [{"metric": k, "value": v} for k, v in flatten(source) if k not in META_KEYS]
    return [markdown_table(rows, ("metric", "value"))]


def render_result(rel_path: str, data: dict) -> str:
    meta = result_meta(data)
    bench = data.get("bench") or (data.get("summary") or {}).get("bench") or Path(rel_path).stem
    lines = [f"### {bench} (`{rel_path}`)", "",
             f"- command: `{meta['command']}`" if meta["command"] else "- command: (not recorded)",
             f"- date: {meta['date'] or '(not recorded)'}",
             f"- machine: {meta['machine'] or '(not recorded)'}", ""]
    if data.get("bench") == "serve_sweep":
        lines += render_sweep(data)
    elif data.get("bench") == "offline":
        lines += render_offline(data)
    else:
        lines += render_generic(data)
    return "\n".join(lines).rstrip() + "\n"


def load_results(results_dir: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """(relative path, JSON) of every result file, and the JSON files that are not results."""
    results, ignored = [], []
    for path in sorted(results_dir.rglob("*.json")):
        rel = path.relative_to(results_dir).as_posix()
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            ignored.append(rel)
            continue
        if isinstance(data, dict) and any(result_meta(data).values()):
            results.append((rel, data))
        else:
            ignored.append(rel)
    return results, ignored


def board_text(results: list[tuple[str, dict]], results_label: str) -> str:
    head = (f"_Generated by `python benchmarks/make_board.py` from `{results_label}/`; "
            "edits between the board markers are overwritten._\n")
    body = [render_result(rel, data) for rel, data in results] or ["(no results yet)\n"]
    return "\n".join([head, *body])


def _marker_line(document: str, marker: str, after: int = 0) -> int:
    """Offset of `marker` standing alone on a line at or after `after` (-1 if none); a marker
    quoted inside prose does not count."""
    match = re.compile(rf"^[ \t]*{re.escape(marker)}[ \t]*$", re.M).search(document, after)
    return match.start() if match else -1


def splice(document: str, board: str) -> str:
    """`document` with the text between the marker lines replaced by `board` (markers appended
    at the end when absent); everything outside the markers is unchanged."""
    block = f"{START}\n{board.rstrip()}\n{END}"
    start = _marker_line(document, START)
    end = _marker_line(document, END, start) if start != -1 else -1
    if end == -1:
        sep = "" if not document or document.endswith("\n\n") else (
            "\n" if document.endswith("\n") else "\n\n")
        return f"{document}{sep}{block}\n"
    end = document.index(END, end)
    return document[:start] + block + document[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "board.md"))
    args = ap.parse_args(argv)
    results_dir, out = Path(args.results_dir), Path(args.out)
    results, ignored = load_results(results_dir) if results_dir.is_dir() else ([], [])
    try:
        label = results_dir.resolve().relative_to(REPO).as_posix()
    except ValueError:
        label = str(results_dir)
    document = out.read_text() if out.is_file() else SKELETON
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(splice(document, board_text(results, label)))
    if ignored:
        print(f"[make_board] {len(ignored)} JSON file(s) without command/date/machine left out "
              f"(e.g. {ignored[0]})", file=sys.stderr)
    print(json.dumps({"out": str(out), "num_results": len(results), "ignored": ignored}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
