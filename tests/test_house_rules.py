"""House rules that keep the repository legible, checked on the tree: source files under 500 lines, no word
of the development history (sessions, `_s19_`-style names) in text files, no dated machine measurements in the
package's source (comments say what and why; figures live in the docs with their date and machine), the README
and the benchmarks page within their length, every `--speculative-config` key documented, every result file
cited by the docs, and CI running exactly the README's test command.

    pytest tests/test_house_rules.py -q
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = {".py", ".sh", ".cpp", ".inc", ".h"}
TEXT_SUFFIXES = SOURCE_SUFFIXES | {".md", ".json", ".toml", ".txt", ".cfg", ".yaml", ".yml"}
HISTORY_WORDS = re.compile(r"session ?[0-9]|\bs[0-9]{1,2}\b", re.IGNORECASE)
# a date or a named machine: a measurement report, which belongs in docs/ beside its command and result file
DATED_MEASUREMENT = re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b|\b[0-9]+-vCPU\b|\bEPYC\b|\bXeon\b")


def _tracked(*roots: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", *roots], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / p for p in out.decode().split("\0") if p and (REPO / p).is_file()]


def test_source_files_are_under_500_lines():
    long = [(str(p.relative_to(REPO)), n) for p in _tracked("dspark", "tests", "benchmarks", "scripts")
            if p.suffix in SOURCE_SUFFIXES and (n := len(p.read_text(errors="replace").splitlines())) >= 500]
    assert not long, f"files of 500 lines or more: {long}"


def test_no_development_history_words_in_text_files():
    hits = []
    for p in _tracked("README.md", "docs", "dspark", "benchmarks", "scripts", "tests", "configs", ".ci",
                      "pyproject.toml"):
        if p.suffix not in TEXT_SUFFIXES and p.parent.name != ".ci" or p == Path(__file__).resolve():
            continue  # weights and images match by chance bytes; this file names the pattern
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if HISTORY_WORDS.search(line):
                hits.append(f"{p.relative_to(REPO)}:{i}: {line.strip()[:80]}")
    assert not hits, "describe the project as it is, without its history:\n" + "\n".join(hits[:20])


def test_history_pattern_catches_what_it_should():
    assert HISTORY_WORDS.search("measured in session 19") and HISTORY_WORDS.search("(s17)")
    assert not HISTORY_WORDS.search("2026-12-02, 2-vCPU Intel Xeon") and not HISTORY_WORDS.search("sps16")


def _package_sources() -> list[Path]:
    return sorted(p for p in (REPO / "dspark").rglob("*")
                  if p.suffix in SOURCE_SUFFIXES and p.is_file() and "__pycache__" not in p.parts)


def test_no_dated_measurements_in_package_source():
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()[:80]}"
            for p in _package_sources()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if DATED_MEASUREMENT.search(line)]
    assert not hits, ("comments and docstrings say what and why; a figure goes to docs/ with its command, "
                      "date and machine, and the code points there:\n" + "\n".join(hits[:20]))


def test_dated_measurement_pattern_catches_what_it_should():
    assert DATED_MEASUREMENT.search("(measured 2026-11-30, 2-vCPU AMD EPYC)")
    assert DATED_MEASUREMENT.search("0.43 vs 1.10 ms on a 2-vCPU machine") and DATED_MEASUREMENT.search("one Xeon thread")
    assert DATED_MEASUREMENT.search("on 2026-12-02")
    assert not DATED_MEASUREMENT.search('docs/benchmarks.md, "Batch-1 decode"')
    assert not DATED_MEASUREMENT.search("CPUs with AVX512-BF16 or AMX") and not DATED_MEASUREMENT.search("2048-token")
    assert not DATED_MEASUREMENT.search("a 20-12 split") and not DATED_MEASUREMENT.search("Qwen3-30B-A3B")


def test_readme_and_benchmarks_page_lengths():
    assert len((REPO / "README.md").read_text().splitlines()) <= 120
    assert len((REPO / "docs" / "benchmarks.md").read_text().splitlines()) <= 400


def test_every_speculative_config_key_is_documented():
    from dataclasses import fields

    from dspark.config import SpecConfig
    page = (REPO / "docs" / "speculative-config.md").read_text()
    missing = [f.name for f in fields(SpecConfig) if f"| `{f.name}`" not in page and f"`, `{f.name}`" not in page]
    assert not missing, f"add a row to docs/speculative-config.md for: {missing}"


def _expand_braces(text: str) -> str:
    """`a{1,2}b` -> `a1b a2b` (docs cite families of result files that way)."""
    pattern = re.compile(r"([\w./-]*)\{([\w,.-]+)\}([\w./-]*)")
    while (m := pattern.search(text)):
        text = text[:m.start()] + " ".join(m[1] + part + m[3] for part in m[2].split(",")) + text[m.end():]
    return text


def test_every_result_file_is_cited_in_the_docs():
    docs = _expand_braces("\n".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
                          + (REPO / "README.md").read_text())
    results = sorted({p.relative_to(REPO / "benchmarks" / "results").parts[0]
                      for p in _tracked("benchmarks/results")})
    uncited = [name for name in results if name not in docs]
    assert not uncited, (f"cite these in docs/ (docs/results-index.md for files behind no current figure) or "
                         f"git rm them: {uncited}")


def test_ci_runs_the_readmes_test_command():
    readme = (REPO / "README.md").read_text()
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(ci) == 1 and ci[0] in readme, ci
