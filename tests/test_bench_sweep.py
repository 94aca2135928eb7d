"""`dspark bench sweep` end to end on a tiny random HF checkpoint written by the test (two real
`dspark serve` subprocesses), the method table, verify-budget delta parsing, `dspark bench offline`
on the same checkpoint, and `benchmarks/make_board.py` (regeneration keeps hand-written notes).
Run: pytest tests/test_bench_sweep.py -q
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.bench.methods import MethodUnavailable, method_spec, parse_method
from dspark.bench.metrics import spec_decode_stats
from tiny_checkpoint import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import make_board  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def test_sweep_end_to_end(tiny_dir, tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "dspark", "bench", "sweep", "--model", str(tiny_dir),
           "--methods", "none,ngram,dspark-k3", "--concurrency", "1,2", "--dataset", "random",
           "--random-input-len", "16", "--num-prompts", "3", "--max-tokens", "8",
           "--out-dir", str(out), "--engine-args", "--num-threads 1", "--start-timeout-s", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # a hang guard, not a speed check
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["num_points"] == 4 and summary["num_failed_points"] == 0
    assert summary["methods"] == ["none", "ngram"]
    assert "dspark-k3" in summary["skipped"] and "drafter" in summary["skipped"]["dspark-k3"]

    results = json.loads((out / "results.json").read_text())
    assert results["command"].startswith("dspark bench sweep") and results["date"]
    assert results["machine"]
    points = results["points"]
    assert {(p["method"], p["max_concurrency"]) for p in points} == {
        (m, c) for m in ("none", "ngram") for c in (1, 2)}
    for p in points:
        assert not p.get("error"), p
        assert p["output_throughput_tok_s"] > 0 and p["per_user_output_tok_s"] > 0
        assert p["num_completed"] == 3 and p["total_output_tokens"] > 0
        assert (out / p["raw_file"]).is_file()
    ngram = [p for p in points if p["method"] == "ngram"]
    assert all(p["spec_decode"] is not None for p in ngram)
    assert sum(p["spec_decode"]["spec_decode_num_verify_budget_samples"] for p in ngram) > 0
    assert all(p["mean_verify_budget"] is not None for p in ngram)
    assert any(p["tau"] is not None and p["tau"] >= 1.0 for p in ngram)
    assert all(p["tau"] is None and p["mean_verify_budget"] is None
               for p in points if p["method"] == "none")
    assert len(results["table"]) == 4
    for row in results["table"]:
        match = [p for p in points if (p["method"], p["max_concurrency"])
                 == (row["method"], row["max_concurrency"])]
        assert row["output_throughput_tok_s"] == pytest.approx(match[0]["output_throughput_tok_s"])

    report = (out / "report.md").read_text()
    assert "## random" in report and "TPOT mean (ms)" in report and "verify budget" in report
    assert "| none | 1 |" in report and "| ngram | 2 |" in report
    assert "dspark-k3" in report  # listed under skipped methods
    for png in ("pareto_random.png", "tpot_vs_concurrency.png", "tau_by_dataset.png",
                "verify_budget_vs_concurrency.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC, png
    assert (out / "logs" / "server_ngram.log").is_file()


def test_sweep_interleaved_takes_turns(tiny_dir, tmp_path):
    """--interleave: both servers up at once, the methods take turns at every grid point, the turn order
    rotated from one point to the next."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "dspark", "bench", "sweep", "--model", str(tiny_dir),
           "--methods", "none,ngram", "--concurrency", "1", "--dataset", "random", "--repeats", "2",
           "--random-input-len", "16", "--num-prompts", "2", "--max-tokens", "8", "--interleave",
           "--out-dir", str(out), "--engine-args", "--num-threads 1", "--start-timeout-s", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # a hang guard
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = json.loads((out / "results.json").read_text())["points"]
    assert [(p["method"], p["repeat"]) for p in points] == [("none", 0), ("ngram", 0), ("ngram", 1), ("none", 1)]
    assert all(not p.get("error") and p["num_completed"] == 2 for p in points)
    # fresh prompts: repeat 1 starts after repeat 0's two prompts and its warm-up, for both methods
    offsets = [json.loads((out / p["raw_file"]).read_text())["prompt_offset"] for p in points]
    assert offsets == [0, 0, 3, 3], offsets


def test_fresh_prompt_offsets_are_disjoint_and_bounded():
    import argparse

    from dspark.bench.sweep import prompt_offsets

    args = argparse.Namespace(dataset=["gsm8k", "humaneval"], concurrency=[1, 4], repeats=2, num_prompts=0,
                              num_prompts_per_concurrency=1, num_warmup=1, seed=0)
    offsets = prompt_offsets(args)
    for d in args.dataset:  # slices [offset, offset + c + warm-up) tile the order without overlap
        spans = sorted((offsets[d, c, r], offsets[d, c, r] + c + 1) for c in (1, 4) for r in range(2))
        assert spans == [(0, 2), (2, 7), (7, 9), (9, 14)], spans
    args.num_prompts, args.repeats = 40, 2  # 2 x 2 x 41 = 164 prompts: gsm8k (319 rows) fits, humaneval (164)
    assert prompt_offsets(args)["humaneval", 4, 1] == 123
    args.num_warmup = 2  # 168: humaneval does not
    with pytest.raises(SystemExit, match="humaneval"):
        prompt_offsets(args)


def test_method_table():
    assert method_spec(parse_method("none")) is None
    assert method_spec(parse_method("ngram")) == {"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert method_spec(parse_method("dspark-k3"), drafter_dir="d") == {
        "method": "dspark", "model": "d", "num_speculative_tokens": 3, "length_policy": "fixed"}
    prefix = method_spec(parse_method("dspark-prefix"), drafter_dir="d", cost_table_path="c.json")
    assert prefix == {"method": "dspark", "model": "d", "length_policy": "prefix",
                      "cost_table": "c.json"}
    assert parse_method("dspark-async").needs_cost_table
    assert not parse_method("dspark-k7").needs_cost_table
    assert method_spec(parse_method("dspark-prefix-lookup"), drafter_dir="d", cost_table_path="c.json") == {
        **prefix, "ngram_first": True}
    assert method_spec(parse_method("dspark-prefix-lookup-unswitched"), drafter_dir="d", cost_table_path="c.json") == {
        **prefix, "ngram_first": True, "measured_switch": False}
    with pytest.raises(MethodUnavailable):
        method_spec(parse_method("eagle3"))
    for bad in ("bogus", "dspark-x", "none-k3", "ngram-prefix", "ngram-lookup", "none-lookup", "dspark-k3-unswitched"):
        with pytest.raises(ValueError):
            parse_method(bad)


def _metrics_text(budget_sum: float, budget_count: float, drafts: float) -> str:
    return (f"# TYPE vllm:spec_decode_num_drafts counter\n"
            f"vllm:spec_decode_num_drafts_total {drafts}\n"
            f"# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
            f"vllm:spec_decode_num_accepted_tokens_total {2 * drafts}\n"
            f"# TYPE vllm:spec_decode_verify_budget histogram\n"
            f'vllm:spec_decode_verify_budget_bucket{{le="+Inf"}} {budget_count}\n'
            f"vllm:spec_decode_verify_budget_count {budget_count}\n"
            f"vllm:spec_decode_verify_budget_sum {budget_sum}\n")


def test_verify_budget_delta():
    stats = spec_decode_stats(_metrics_text(10, 5, 2), _metrics_text(40, 15, 6))
    assert stats["spec_decode_mean_verify_budget"] == pytest.approx(30 / 10)
    assert stats["spec_decode_num_verify_budget_samples"] == 10
    assert stats["spec_decode_acceptance_length"] == pytest.approx(3.0)
    no_budget = spec_decode_stats(_metrics_text(10, 5, 2), _metrics_text(10, 5, 2))
    assert "spec_decode_mean_verify_budget" not in no_budget


def test_offline_bench(tiny_dir, tmp_path, capsys):
    from dspark.cli import main

    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", str(tiny_dir), "--dataset", "random",
               "--num-prompts", "2", "--max-tokens", "8", "--batch-sizes", "1,3", "--peers",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
               "--out", str(out)])
    assert rc == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    assert [r["batch_size"] for r in line["throughput"]] == [1, 3]
    assert all(r["batch_output_tok_s"] > 0 for r in line["throughput"])
    assert line["throughput"][1]["total_output_tokens"] == 3 * 8  # EOS ignored: fixed length
    assert line["batch1"]["dspark"]["decode_tok_s"] > 0
    assert line["batch1"]["hf_transformers"]["total_output_tokens"] == 2 * 8
    assert "hf_transformers_prompt_lookup_k4" in line["batch1"]
    # an HF folder: llama.cpp is skipped, for being absent or (when installed) for the model format
    expected = "not a GGUF" if importlib.util.find_spec("llama_cpp") else "not installed"
    assert expected in line["skipped_peers"]["llama_cpp"]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python not installed (PEERS=1 bash scripts/setup.sh)")
def test_llama_cpp_peer_decodes_the_shipped_q4_1():
    """The llama.cpp peer on the embedded Q4_1 GGUF, in a child process: with llama-cpp-python's runtime
    weight repacking on, its first decode segfaults on this project's AVX-512 machines (the peer turns
    repacking off)."""
    ids = [1, 4093, 198, 23830, 288, 2229, 30, 2, 198, 1, 520, 9531, 198]  # a short chat, SmolLM2 ids
    code = ("import json; from dspark.bench.peers import llama_cpp_peer; "
            f"out, skipped = llama_cpp_peer(model='default', prompt_ids=[{ids}], lengths=[6], "
            "prompt_lookup_num_tokens=3, num_threads=1); print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["llama_cpp"]["gguf"].endswith("Q4_1.gguf")
    assert out["llama_cpp"]["decode_tok_s"] > 0  # tokens after the first were decoded and timed


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_make_board_keeps_notes(tmp_path, capsys):
    results = tmp_path / "results"
    meta = {"command": "dspark bench sweep --x", "date": "2026-01-01", "machine": "box"}
    _write(results / "sweep" / "results.json", {"bench": "serve_sweep", **meta, "skipped": {},
           "table": [{"dataset": "gsm8k", "method": "ngram", "max_concurrency": 4,
                      "mean_tpot_ms": 12.5, "output_throughput_tok_s": 321.0,
                      "per_user_output_tok_s": 80.0, "tau": 2.5, "mean_verify_budget": 3.25,
                      "num_repeats": 2}]})
    _write(results / "sweep" / "raw" / "ngram_gsm8k_c4_r0.json", {"config": {}, "requests": []})
    _write(results / "decode.json", {"summary": {"bench": "decode_batch1", "date": "2026-01-02",
                                                 "machine": "box", "decode_tok_s_median":
                                                 {"dspark_fp32": 99.5}}, "per_prompt": {}})
    _write(results / "offline.json", {"bench": "offline", **meta, "throughput": [
        {"batch_size": 8, "num_prompts": 8, "total_output_tokens": 64, "batch_output_tok_s": 7.0}],
        "batch1": {"dspark": {"median_ttft_ms": 1.0, "median_tpot_ms": 2.0, "decode_tok_s": 500.0,
                              "tau": None}}, "skipped_peers": {"llama_cpp": "absent"}})
    doc = tmp_path / "benchmarks.md"
    notes_before = (f"# Benchmarks\n\nHand notes: the board sits between `{make_board.START}` "
                    f"and `{make_board.END}`.\n\n")
    notes_after = "\n\n## Notes\nKeep me *exactly*.\n"
    doc.write_text(f"{notes_before}{make_board.START}\nOLD BOARD\n{make_board.END}{notes_after}")

    argv = ["--results-dir", str(results), "--out", str(doc)]
    assert make_board.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_results"] == 3
    assert summary["ignored"] == ["sweep/raw/ngram_gsm8k_c4_r0.json"]
    text = doc.read_text()
    assert text.startswith(notes_before) and text.endswith(notes_after)
    assert "OLD BOARD" not in text
    board = text[len(notes_before):-len(notes_after)]
    assert board.startswith(make_board.START) and board.endswith(make_board.END)
    assert "`dspark bench sweep --x`" in board and "| ngram | 4 | 12.50 | 321.00" in board
    assert "decode_tok_s_median.dspark_fp32 | 99.50" in board and "(not recorded)" in board
    assert "| 8 | 8 | 64 | 7.00 |" in board and "skipped `llama_cpp`" in board
    assert make_board.main(argv) == 0 and doc.read_text() == text  # idempotent

    bare = tmp_path / "bare.md"
    bare.write_text("# Mine\nno markers here\n")
    assert make_board.main(["--results-dir", str(results), "--out", str(bare)]) == 0
    bare_text = bare.read_text()
    assert bare_text.startswith("# Mine\nno markers here\n\n" + make_board.START)
    assert bare_text.rstrip().endswith(make_board.END)
