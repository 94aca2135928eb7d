"""Tensor parallelism with gloo on this machine (two processes: rank 0 is the test's own, rank 1 a worker the
engine starts): the logits of every step equal one process's within 1e-5 in fp32, greedy output is the same
with and without speculation, and a rank that dies or hangs fails the engine loudly instead of hanging it."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from dspark import kernels
from dspark.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpecConfig
from dspark.distributed.group import even_split
from dspark.distributed.runner import WorkerFailure
from dspark.engine.build import build_engine
from dspark.llm import LLM
from dspark.sampling import SamplingParams
from tests.conftest import TINY_GEMMA3, TINY_LLAMA, TINY_QWEN3, hf_twin

# an untied Qwen3 (a tied random one repeats its input token) with 3 KV heads: the ranks keep 2 and 1
QWEN3_UNEVEN = dataclasses.replace(TINY_QWEN3, tie_word_embeddings=False, num_attention_heads=6,
                                   num_key_value_heads=3, intermediate_size=100)
# Gemma 3 (sliding-window layers, soft-capped logits) shards by the same structure
CONFIGS = {"llama": TINY_LLAMA, "qwen3": TINY_QWEN3, "qwen3_uneven": QWEN3_UNEVEN, "gemma3": TINY_GEMMA3}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [20, 21, 22], list(range(30, 60))]
SLOW = pytest.mark.slow  # two processes per engine: the default run keeps one case of each claim


def cases(*fast: str) -> list:
    return [pytest.param(n, marks=() if n in fast else SLOW) for n in CONFIGS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def write_checkpoint(cfg, path) -> str:
    from tests.tiny_checkpoint import write_tiny_checkpoint
    write_tiny_checkpoint(path)  # the tokenizer files; the model is replaced by the random twin of `cfg`
    hf_twin(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


def engine_config(model: str, tp: int, *, spec: SpecConfig | None = None, timeout_s: float = 60.0,
                  vocab_parallel_argmax: bool = True, **kw) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", num_threads=1,
                        cache=CacheConfig(kv_block_size=4, num_kv_blocks=96),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64, coalesce_steps=0), spec=spec,
                        parallel=ParallelConfig(tensor_parallel_size=tp, distributed_timeout_s=timeout_s,
                                                vocab_parallel_argmax=vocab_parallel_argmax), **kw)


def run_recording(config: EngineConfig, prompts, params=GREEDY):
    """(greedy outputs, the logits of every step) of an engine built from `config`, closed after."""
    engine, _ = build_engine(config)
    steps: list[torch.Tensor] = []
    forward = engine.runner.forward

    def recording(batch, **kw):
        logits, taps = forward(batch, **kw)
        steps.append(logits.clone())
        return logits, taps

    engine.runner.forward = recording
    try:
        outputs = [o.token_ids for o in LLM(engine=engine, tokenizer=None).generate(prompts, params)]
    finally:
        if getattr(engine, "workers", None) is not None:
            engine.workers.close()
    return outputs, steps


def test_even_split_covers_the_range():
    assert even_split(9, 2) == [(0, 5), (5, 4)]
    assert even_split(3, 2) == [(0, 2), (2, 1)]
    assert even_split(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]


def torch_path(monkeypatch) -> None:
    """The device-agnostic path (no CPU kernels) in this process and in the workers it starts."""
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "ops", lambda: None)


@pytest.mark.parametrize("name", cases("llama", "qwen3_uneven"))
def test_tp2_logits_and_greedy_output_equal_one_process(name, tmp_path, monkeypatch):
    """The torch path (the one CUDA runs): the ranks' partial sums, all-reduced, give one process's logits
    within 1e-5 at every step of prompt chunks and decoding (the rows gathered: greedy steps would merge
    the ranks' argmax instead, tests/test_tensor_parallel_argmax.py)."""
    torch_path(monkeypatch)
    path = write_checkpoint(CONFIGS[name], tmp_path / name)
    one, one_logits = run_recording(engine_config(path, 1), PROMPTS)
    two, two_logits = run_recording(engine_config(path, 2, vocab_parallel_argmax=False), PROMPTS)
    assert two == one
    assert len(two_logits) == len(one_logits)
    for a, b in zip(one_logits, two_logits):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", cases("qwen3"))
def test_tp2_with_cpu_kernels_greedy_output_equals_one_process(name, tmp_path):
    """With the CPU kernels (where built) the shards' products run through the kernels' tiles, whose
    summation order differs from the whole matrix's: greedy output is the same; the logits stay within
    1e-3 (measured: 0 on the tiny Llama, 4.3e-4 on the tiny tied Qwen3, whose logits with the kernels on
    and off differ by 2.8e-3 on one process already)."""
    path = write_checkpoint(CONFIGS[name], tmp_path / name)
    one, one_logits = run_recording(engine_config(path, 1), PROMPTS)
    two, two_logits = run_recording(engine_config(path, 2, vocab_parallel_argmax=False), PROMPTS)
    assert two == one
    for a, b in zip(one_logits, two_logits):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", [pytest.param("llama", marks=SLOW), "qwen3_uneven"])
def test_tp2_speculative_greedy_equals_plain(name, tmp_path):
    """Prompt lookup drafts on rank 0; verification reads the ranks' merged argmax (greedy steps)."""
    path = write_checkpoint(CONFIGS[name], tmp_path / name)
    prompts = PROMPTS + [[40, 41, 42, 43] * 6]
    plain, _ = run_recording(engine_config(path, 2), prompts)
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    speculative, _ = run_recording(engine_config(path, 2, spec=spec), prompts)
    assert speculative == plain


def test_tp_refuses_what_it_cannot_split(tmp_path):
    path = write_checkpoint(TINY_LLAMA, tmp_path / "llama")  # 2 KV heads
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        build_engine(engine_config(path, 3))
    with pytest.raises(ValueError, match="draft_model"):
        build_engine(engine_config(path, 2, spec=SpecConfig(method="draft_model", draft_num_layers=1)))
    with pytest.raises(ValueError, match="q4_1 runs on one process"):
        build_engine(engine_config(path, 2, matmul_dtype="q4_1"))


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_rank_that_dies_or_hangs_fails_the_engine(how, tmp_path, monkeypatch):
    """SIGKILL: gloo sees the socket close and the step raises at once; SIGSTOP (alive, never answering): the
    step raises when the group timeout runs out. Neither hangs. Rank 0 takes longer than a heartbeat period
    to build its engine here, so the worker sees heartbeats before its pool size."""
    from dspark.engine import build as build_module
    build_policy = build_module.build_policy
    monkeypatch.setattr(build_module, "build_policy", lambda *a: (time.sleep(3.0), build_policy(*a))[1])
    path = write_checkpoint(TINY_LLAMA, tmp_path / "llama")
    engine, _ = build_engine(engine_config(path, 2, timeout_s=4.0))
    worker = engine.workers.procs[0]
    try:
        engine.add_request(PROMPTS[0], GREEDY)
        engine.step()  # a healthy step first
        os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        if how == "killed":
            worker.join(10.0)
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match="tensor-parallel"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < 60.0  # a hang guard, not a speed claim
    finally:
        if how == "stopped" and worker.exitcode is None:
            os.kill(worker.pid, signal.SIGKILL)
        engine.workers.close()
    with pytest.raises(WorkerFailure):
        engine.step()  # stays failed


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_children(pid: int) -> list[int]:
    from pathlib import Path
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text()]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_served_engine_with_a_dead_rank_fails_loudly(tmp_path):
    """`dspark serve -tp 2`: after its worker is killed, the next request gets a 500 naming the failure and
    the server exits non-zero instead of hanging. A killed worker closes its gloo socket, which the server
    sees at once; the group timeout is long (60 s) so that a worker slowed by a loaded machine before the
    kill is not taken for a dead one."""
    import subprocess
    import sys

    import httpx
    path = write_checkpoint(TINY_LLAMA, tmp_path / "llama")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "dspark", "serve", path, "-tp", "2", "--device", "cpu",
                             "--port", str(port), "--distributed-timeout-s", "60", "--num-threads", "1",
                             "--speculative-config", "none"], stdout=log, stderr=subprocess.STDOUT)
    body = {"model": path, "prompt": [5, 6, 7], "max_tokens": 8}
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        assert httpx.post(base + "/v1/completions", json=body, timeout=120).status_code == 200
        workers = _spawned_children(proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        resp = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 500 and "tensor-parallel" in resp.text
        assert proc.wait(120) != 0
    finally:
        proc.kill()
        proc.wait(10)
        log.close()
