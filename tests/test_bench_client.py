"""End-to-end test of `dspark bench serve` against a tiny fake OpenAI-compatible streaming server
(FastAPI + uvicorn on 127.0.0.1, in a background thread), plus the dataset loader and the chunk
parser. Run: pytest tests/test_bench_client.py -q

The fake server streams, per request: a role chunk, then after a first-token delay read from the
prompt ("delay_ms=NNN"), `len(CHUNK_TOKENS)` content chunks `GAP_S` apart carrying CHUNK_TOKENS
tokens each, then a usage chunk. Chat chunks carry dspark's `num_tokens`; completions chunks carry
cumulative `usage` instead (vLLM's continuous usage stats). /metrics exposes vllm:spec_decode_*
counters that grow by SPEC_PER_REQUEST per finished request.
"""

import asyncio
import json
import re
import socket
import threading
import time

import pytest

from dspark.bench import cli
from dspark.bench.client import BenchConfig, _consume_chunk, _StreamState, arrival_offsets_s
from dspark.bench.datasets import datasets_dir, load_prompts

CHUNK_TOKENS = (1, 3, 2, 1, 3)  # 10 tokens in 5 chunks
GAP_S = 0.04
# drafts, draft tokens, accepted tokens, accepted per position (3 positions)
SPEC_PER_REQUEST = (4, 12, 5, (3, 2, 0))
DELAYS_MS = (100, 500, 200, 600, 300, 400)  # 100 ms apart: TTFT order survives CPU jitter


def _make_app():
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse, StreamingResponse

    app = FastAPI()
    counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0, 0, 0]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        lines = []
        for name, key in (("num_drafts", "drafts"), ("num_draft_tokens", "draft_tokens"),
                          ("num_accepted_tokens", "accepted")):
            lines += [f"# TYPE vllm:spec_decode_{name} counter",
                      f'vllm:spec_decode_{name}_total{{model_name="fake-model"}} {counters[key]}']
        lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}} {v}'
                  for p, v in enumerate(counters["per_pos"])]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def stream(prompt: str, chat: bool):
        delay_s = int(re.search(r"delay_ms=(\d+)", prompt).group(1)) / 1000
        base = {"id": "x", "model": "fake-model", "object": "chat.completion.chunk"}
        if chat:
            yield _sse(base | {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(delay_s)
        emitted = 0
        for i, n in enumerate(CHUNK_TOKENS):
            if i:
                await asyncio.sleep(GAP_S)
            emitted += n
            if chat:
                choice = {"index": 0, "delta": {"content": "tok" * n}, "num_tokens": n}
                yield _sse(base | {"choices": [choice]})
            else:
                usage = {"prompt_tokens": 3, "completion_tokens": emitted}
                yield _sse(base | {"choices": [{"index": 0, "text": "tok" * n}], "usage": usage})
        finish = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else \
            {"index": 0, "text": "", "finish_reason": "length"}
        yield _sse(base | {"choices": [finish]})
        drafts, draft_tokens, accepted, per_pos = SPEC_PER_REQUEST
        counters["drafts"] += drafts
        counters["draft_tokens"] += draft_tokens
        counters["accepted"] += accepted
        counters["per_pos"] = [a + b for a, b in zip(counters["per_pos"], per_pos)]
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": emitted}
        yield _sse(base | {"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        return StreamingResponse(stream(body["messages"][0]["content"], True),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        return StreamingResponse(stream(body["prompt"], False), media_type="text/event-stream")

    return app


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture(scope="module")
def server_url():
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_make_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start within 20 s"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture()
def delay_dataset(tmp_path):
    path = tmp_path / "delays.jsonl"
    rows = [{"turns": [f"please answer delay_ms={d}", "second turn"], "domain": "chat",
             "source": f"delay{d}"} for d in DELAYS_MS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _max_overlap(records) -> int:
    events = sorted([(r["send_s"], 1) for r in records] + [(r["end_s"], -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak


def test_cli_end_to_end_chat(server_url, delay_dataset, tmp_path, capsys):
    result_file = tmp_path / "out" / "result.json"
    rc = cli.main(["serve", "--base-url", server_url + "/v1", "--dataset", delay_dataset,
                   "--num-prompts", str(len(DELAYS_MS)), "--max-concurrency", "2",
                   "--request-rate", "10", "--num-warmup", "1", "--max-tokens", "10",
                   "--ignore-eos", "--disable-tqdm", "--result-file", str(result_file),
                   "--label", "fake"])
    assert rc == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last_line)  # the last stdout line must be one JSON object
    assert summary["model"] == "fake-model" and summary["label"] == "fake"
    assert (summary["completed"], summary["failed"]) == (len(DELAYS_MS), 0)
    assert summary["total_output_tokens"] == len(DELAYS_MS) * sum(CHUNK_TOKENS)
    assert summary["num_chunks"] == len(DELAYS_MS) * len(CHUNK_TOKENS)
    assert summary["mean_tokens_per_chunk"] == pytest.approx(2.0)
    assert summary["total_input_tokens"] == len(DELAYS_MS) * 3
    assert "requests" not in summary

    # Speculation stats are deltas: the warm-up request is excluded.
    n = len(DELAYS_MS)
    assert (summary["spec_decode_num_drafts"], summary["spec_decode_draft_tokens"],
            summary["spec_decode_accepted_tokens"]) == (4 * n, 12 * n, 5 * n)
    assert summary["spec_decode_acceptance_length"] == pytest.approx(1 + 5 / 4)
    assert summary["spec_decode_acceptance_rate"] == pytest.approx(100 * 5 / 12)
    assert summary["spec_decode_per_position_acceptance_rates"] == pytest.approx([3 / 4, 2 / 4, 0.0])

    # Independent clock: perf_counter wall time x output throughput ~ counted tokens (2%).
    clock = summary["clock_check"]
    assert clock["counted_output_tokens"] == summary["total_output_tokens"]
    assert abs(clock["relative_error"]) < 0.02, f"clock check off by {clock['relative_error']:.2%}"

    # ITL is per chunk (>= GAP_S apart); TPOT is per token: (E2EL - TTFT) / 9 covers the same
    # 4 gaps (plus the short stream tail) spread over 9 tokens, so ITL ~ 2.25 x TPOT here.
    assert summary["median_itl_ms"] > 1.5 * summary["median_tpot_ms"], "ITL should exceed TPOT"

    full = json.loads(result_file.read_text())
    records = full["requests"]
    assert len(records) == n and full["config"]["max_concurrency"] == 2
    assert _max_overlap(records) <= 2, "max_concurrency=2 exceeded"
    offsets = arrival_offsets_s(n, 10.0, 1.0, seed=0)
    for r in records:
        assert r["send_s"] >= offsets[r["request_index"]] - 1e-3, "sent before its arrival time"
        assert r["chunk_num_tokens"] == list(CHUNK_TOKENS)
        gaps_s = [b - a for a, b in zip(r["chunk_arrival_s"], r["chunk_arrival_s"][1:])]
        tpot_s = (r["end_s"] - r["chunk_arrival_s"][0]) / (sum(CHUNK_TOKENS) - 1)
        tail_s = tpot_s * (sum(CHUNK_TOKENS) - 1) - sum(gaps_s)  # last chunk -> stream end
        assert tail_s >= 0, f"stream tail {tail_s:.3f}s: TPOT = (sum ITL + tail) / 9"
    ttft_by_delay = sorted((int(r["prompt_source"][5:]), r["chunk_arrival_s"][0] - r["send_s"])
                           for r in records)
    for delay_ms, ttft_s in ttft_by_delay:
        assert ttft_s * 1000 >= delay_ms - 1, f"TTFT {ttft_s:.3f}s below server delay {delay_ms}ms"


def test_run_bench_completions_usage_deltas(server_url, delay_dataset):
    cfg = BenchConfig(base_url=server_url, endpoint="completions", dataset=delay_dataset,
                      num_prompts=3, max_concurrency=3, num_warmup=0, disable_tqdm=True)
    result = cli.run_bench(cfg)
    assert result["completed"] == 3
    for r in result["requests"]:  # token counts recovered from cumulative usage per chunk
        assert tuple(r["chunk_num_tokens"]) == CHUNK_TOKENS and r["num_output_tokens"] == 10
    assert result["spec_decode_num_drafts"] == 12


def test_unreachable_server_records_errors(tmp_path, delay_dataset):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = BenchConfig(base_url=f"http://127.0.0.1:{port}", model="m", dataset=delay_dataset,
                      num_prompts=2, num_warmup=0, disable_tqdm=True, request_timeout_s=5)
    result = cli.run_bench(cfg)
    assert (result["completed"], result["failed"]) == (0, 2)
    assert "ConnectError" in result["first_error"] and "spec_decode_num_drafts" not in result


def test_consume_chunk_token_counting():
    state = _StreamState()
    _consume_chunk({"choices": [{"delta": {"role": "assistant"}}]}, 0.1, state)  # not content
    _consume_chunk({"choices": [{"delta": {"content": "a"}}]}, 0.2, state)  # plain: 1 token
    _consume_chunk({"choices": [{"delta": {"content": "bc"}, "num_tokens": 4}]}, 0.3, state)
    _consume_chunk({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}, 0.4,
                   state)
    assert state.chunk_arrival_s == [0.2, 0.3] and state.chunk_num_tokens == [1, 4]
    assert (state.num_prompt_tokens, state.usage_completion_tokens) == (7, 5)
    bad = _StreamState()
    _consume_chunk({"error": {"message": "overloaded"}}, 0.1, bad)
    assert "overloaded" in bad.error


def test_arrival_offsets():
    assert list(arrival_offsets_s(3, float("inf"), 1.0, seed=0)) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets_s(20001, 50.0, 1.0, seed=1)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    # mean gap 1/rate; over 20000 gaps the sample mean is within 3% (about 4 sigma for Poisson)
    assert offsets[-1] / 20000 == pytest.approx(1 / 50, rel=0.03)
    bursty = arrival_offsets_s(20001, 50.0, 0.25, seed=1)
    gaps_cv = (lambda g: g.std() / g.mean())(bursty[1:] - bursty[:-1])
    assert gaps_cv == pytest.approx(2.0, rel=0.1), "gamma shape 0.25 has CV = 1/sqrt(0.25) = 2"


def test_datasets_from_env_dir(tmp_path, monkeypatch):
    (tmp_path / "eval").mkdir()
    (tmp_path / "train").mkdir()
    rows = [{"turns": [f"q{i}", "follow-up"], "domain": "chat", "source": "mt-bench"}
            for i in range(5)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "eval" / "mt-bench.jsonl").write_text(text)
    (tmp_path / "train" / "arena.jsonl").write_text(text)
    monkeypatch.setenv("DSPARK_DATASETS", str(tmp_path))
    assert datasets_dir() == tmp_path
    a = load_prompts("mt-bench", 5, seed=0)
    assert sorted(p.prompt for p in a) == [f"q{i}" for i in range(5)]  # first turn only
    assert [p.prompt for p in load_prompts("mt-bench", 5, seed=0)] == [p.prompt for p in a]
    assert len(load_prompts("mt-bench", 12, seed=0)) == 12  # cycles
    with pytest.raises(ValueError, match="training"):
        load_prompts(str(tmp_path / "train" / "arena.jsonl"))
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompts("nope")
    rand = load_prompts("random", 3, seed=0, random_input_len=16)
    assert len(rand) == 3 and all(len(p.prompt.split()) == 16 for p in rand)


@pytest.mark.skipif(not (datasets_dir() / "eval" / "gsm8k.jsonl").exists(),
                    reason="shared eval datasets not present")
def test_datasets_shared_eval_sets():
    a, b = load_prompts("gsm8k", 10, seed=0), load_prompts("gsm8k", 10, seed=1)
    assert len(a) == 10 and [p.prompt for p in a] != [p.prompt for p in b]
    assert {p.source for p in load_prompts("code", seed=0)} == {"humaneval", "mbpp",
                                                                "livecodebench"}
    assert len(load_prompts("all")) == 1050


VLLM_RESULT_KEYS = ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
                    "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
                    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
                    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
                    "spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
                    "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
                    "spec_decode_per_position_acceptance_rates")


def test_vllm_bench_serve_flags_write_vllms_keys(server_url, tmp_path, capsys):
    """A `vllm bench serve` command line, `vllm` replaced by `dspark`: vLLM's flags, vLLM's result keys."""
    custom = tmp_path / "custom.jsonl"
    custom.write_text("".join(json.dumps({"prompt": f"answer delay_ms={d}"}) + "\n" for d in DELAYS_MS[:4]))
    host, port = server_url.removeprefix("http://").split(":")
    rc = cli.main(["serve", "--backend", "openai-chat", "--host", host, "--port", port,
                   "--endpoint", "/v1/chat/completions", "--model", "fake-model", "--tokenizer", "fake/tok",
                   "--dataset-name", "custom", "--dataset-path", str(custom), "--custom-output-len", "10",
                   "--num-prompts", "4", "--num-warmups", "1", "--max-concurrency", "2", "--request-rate", "inf",
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                   "--goodput", "ttft:100000", "tpot:100000", "--extra-body", '{"top_k": 1}',
                   "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path / "res"),
                   "--result-filename", "run.json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "res" / "run.json").read_text())
    for result in (summary, saved):
        missing = [k for k in VLLM_RESULT_KEYS if k not in result]
        assert not missing, missing
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "std", "p50", "p99"):
                assert isinstance(result[f"{stat}_{metric}_ms"], float), (stat, metric)
    assert (summary["completed"], summary["failed"], summary["backend"]) == (4, 0, "openai-chat")
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])  # every request met it
    assert summary["spec_decode_acceptance_rate"] == pytest.approx(100 * 5 / 12)  # percent, as vLLM
    assert summary["max_concurrent_requests"] == 2 and saved["config"]["extra_body"] == '{"top_k": 1}'
    assert len(saved["requests"]) == 4 and saved["config"]["max_tokens"] == 10
    assert re.fullmatch(r"\d{8}-\d{6}", summary["date"])


def test_build_payload_extra_body_and_endpoint_spellings():
    from dspark.bench.client import build_payload
    cfg = BenchConfig(endpoint="/v1/completions", extra_body='{"top_k": 1, "ignore_eos": true}')
    payload = build_payload(cfg, "m", "hi")
    assert cfg.endpoint == "completions" and payload["prompt"] == "hi" and payload["top_k"] == 1
    assert BenchConfig(backend="openai-chat").endpoint == "chat" and BenchConfig(backend="vllm").endpoint == "completions"
    assert BenchConfig(port=9001).base_url == "http://127.0.0.1:9001"
    with pytest.raises(ValueError, match="percentile_metrics"):
        BenchConfig(percentile_metrics="ttft,bogus")
