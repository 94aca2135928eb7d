"""Multi-node tensor parallelism on loopback: two "nodes" are two `dspark serve` processes started on their own
(subprocess, no shared parent), meeting over torch.distributed's store at --master-addr/--master-port. Node 0
serves HTTP with greedy output equal to one process's; node 1 runs its rank headless; nodes started with
different models stop with an error naming what differs, before loading weights; torchrun's environment
forms the same group as the flags; and the flags' bad values are refused naming them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dspark.config import ParallelConfig
from dspark.distributed.rendezvous import differences, from_environment, local_ranks, remote_ranks
from tests.conftest import TINY_LLAMA, TINY_QWEN3
from tests.test_tensor_parallel import GREEDY, PROMPTS, engine_config, write_checkpoint

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(model: str, node_rank: int, master_port: int, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "dspark", "serve", model, "--tensor-parallel-size", "2", "--nnodes", "2",
            "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
            "--speculative-config", "none", "--num-threads", "1", "--block-size", "4", "--num-kv-blocks", "96",
            "--max-num-batched-tokens", "64", "--log-level", "warning", "--disable-log-stats", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSPARK_CPU_KERNELS": "0"}  # the torch path: exact sums
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def wait_healthy(url: str, procs, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"a node exited with {p.returncode}:\n{p.stderr.read()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("node 0 did not become healthy")


def test_two_nodes_started_on_their_own_serve_one_process_greedy_output(tmp_path, monkeypatch):
    from dspark.engine.build import build_engine
    from dspark.llm import LLM

    model = write_checkpoint(TINY_LLAMA, tmp_path / "llama")
    master, http = free_port(), free_port()
    nodes = [start_node(model, 1, master), start_node(model, 0, master, "--port", str(http))]
    try:
        monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
        engine, tokenizer = build_engine(engine_config(model, 1))  # the reference, while the nodes start
        expected = [o.outputs[0].text for o in LLM(engine=engine, tokenizer=tokenizer).generate(PROMPTS, GREEDY)]
        url = f"http://127.0.0.1:{http}"
        wait_healthy(url, nodes)
        got = []
        for prompt in PROMPTS:
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == expected
        nodes[1].terminate()  # node 0 drains and stops the group: node 1 leaves on its own
        assert nodes[1].wait(60) == 0 and nodes[0].wait(60) == 0, nodes[0].stderr.read()[-2000:]
    finally:
        stop(*nodes)


def test_torchrun_starts_the_group_from_its_environment(tmp_path, monkeypatch):
    """`torchrun --nproc-per-node 2 -m dspark serve MODEL -tp 2`: its agent holds the store and sets RANK /
    WORLD_SIZE / MASTER_*; rank 0 serves what one process serves."""
    from dspark.engine.build import build_engine
    from dspark.llm import LLM

    model = write_checkpoint(TINY_LLAMA, tmp_path / "llama")
    http = free_port()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    argv = [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), "-m", "dspark", "serve", model, "-tp", "2", "--speculative-config", "none",
            "--num-threads", "1", "--port", str(http), "--log-level", "warning", "--disable-log-stats"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSPARK_CPU_KERNELS": "0"}
    group = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
        engine, tokenizer = build_engine(engine_config(model, 1))
        expected = LLM(engine=engine, tokenizer=tokenizer).generate(PROMPTS[:1], GREEDY)[0].outputs[0].text
        url = f"http://127.0.0.1:{http}"
        wait_healthy(url, [group])
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": PROMPTS[0], "max_tokens": GREEDY.max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
    finally:
        stop(group)


def test_nodes_with_different_models_stop_naming_the_difference(tmp_path):
    llama = write_checkpoint(TINY_LLAMA, tmp_path / "llama")
    qwen = write_checkpoint(TINY_QWEN3, tmp_path / "qwen")
    master = free_port()
    nodes = [start_node(llama, 0, master, "--port", str(free_port())), start_node(qwen, 1, master)]
    try:
        errors = [p.communicate(timeout=180)[1] for p in nodes]
    finally:
        stop(*nodes)
    for p, err in zip(nodes, errors):
        assert p.returncode != 0
        assert "tensor-parallel nodes disagree on their configuration" in err, err[-3000:]
        assert "model: node 1 has 'Qwen3ForCausalLM" in err and "node 0 has 'LlamaForCausalLM" in err
        assert "Traceback" not in err  # a clear error, not a crash


def test_torchrun_environment_forms_the_group_and_the_layout_splits_the_ranks():
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "0"}
    p = from_environment(ParallelConfig(tensor_parallel_size=2), env)
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (2, 1, "10.0.0.1", 29500)
    assert from_environment(ParallelConfig(), {}) == ParallelConfig()
    four = ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1)
    assert list(local_ranks(four)) == [2, 3] and remote_ranks(four) == [0, 1]
    assert differences(1, {"dtype": "bfloat16"}, {"dtype": "float32"}) == [
        "dtype: node 1 has 'bfloat16', node 0 has 'float32'"]


@pytest.mark.parametrize("kwargs, message", [
    ({"nnodes": 0}, "--nnodes must be >= 1"),
    ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, "--node-rank must be in [0, --nnodes 2)"),
    ({"nnodes": 2, "tensor_parallel_size": 3}, "--tensor-parallel-size 3 does not spread evenly over --nnodes 2"),
    ({"master_port": 0}, "--master-port must be in [1, 65535]"),
    ({"headless": True}, "--headless is for the nodes of --node-rank > 0"),
])
def test_bad_multinode_flags_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**kwargs)
