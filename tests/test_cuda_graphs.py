"""CUDA-graph replay equals eager: the graphed runner's dense layout, padding (scratch-block K/V) and
read-back, checked on the CPU with the eager stand-in backend through the same code CUDA runs (the torch
path, CPU kernels off); every tensor a captured graph reads outlives the capture (the stand-in with CUDA
graphs' lifetimes, `LifetimeCheckBackend`); the real capture on a GPU (`gpu`). Also: the CUDA path's code
never loads the CPU kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark import kernels
from dspark.worker.cuda_graphs import (EagerBackend, GraphedRunner, LifetimeCheckBackend, batch_buckets,
                                       bucket_for)
from dspark.models.attention import build_attn_metadata, SeqSpec
from tests.conftest import TINY_GEMMA3, TINY_LLAMA, TINY_QWEN3
from tests.engine_helpers import ngram_engine_args, greedy, make_engine, repetitive_prompts, run, tiny_target


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(1) == [1] and batch_buckets(6) == [1, 2, 4, 6]
    assert bucket_for(3, [1, 2, 4]) == 4 and bucket_for(5, [1, 2, 4]) is None


def _recorded(engine):
    steps = []
    forward = engine.runner.forward

    def recording(batch, **kw):
        logits, taps = forward(batch, **kw)
        steps.append((logits.clone(), None if taps is None else taps.clone()))
        return logits, taps
    engine.runner.forward = recording
    return steps


CONFIGS = pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_QWEN3, TINY_GEMMA3], ids=["llama", "qwen3", "gemma3"])


@CONFIGS
@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "verify"])
def test_replay_equals_eager(cfg, speculative, monkeypatch):
    monkeypatch.setattr(kernels, "ops", lambda: None)  # the device-agnostic path CUDA runs
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(6, cfg.vocab_size, seed=3)
    kw = ngram_engine_args() if speculative else {}
    eager = make_engine(model, cfg, **kw)
    eager_steps = _recorded(eager)
    expected = run(eager, prompts, greedy(24))
    graphed = make_engine(model, cfg, **(ngram_engine_args() if speculative else {}))
    graphed.runner = GraphedRunner(graphed.runner, backend=EagerBackend(), max_num_seqs=16)
    runner = graphed.runner
    graphed_steps = _recorded(graphed)
    assert run(graphed, prompts, greedy(24)) == expected
    assert runner.num_replays > 10 and runner.num_eager > 0  # decode steps replayed, prompt steps eager
    if speculative:
        assert any(key[1] > 1 for key in runner.graphs), "verification widths were graphed"
    assert len(graphed_steps) == len(eager_steps)
    for (a, ta), (b, tb) in zip(eager_steps, graphed_steps):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        assert (ta is None) == (tb is None)
        if ta is not None:
            torch.testing.assert_close(tb, ta, atol=1e-5, rtol=0)
    assert graphed.block_manager.num_free_blocks == eager.block_manager.num_free_blocks


@CONFIGS
@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "verify"])
def test_captured_graphs_read_only_tensors_that_outlive_the_capture(cfg, speculative, monkeypatch):
    """A CUDA graph replays the raw addresses its capture read: the stand-in that keeps only what
    `CudaGraphBackend` keeps checks before every replay that each tensor the captured step read (and did
    not create) is still alive, and replays the step; greedy output equals eager decoding."""
    monkeypatch.setattr(kernels, "ops", lambda: None)  # attention as aten ops, which the recorder sees
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(6, cfg.vocab_size, seed=3)
    expected = run(make_engine(model, cfg, **(ngram_engine_args() if speculative else {})), prompts, greedy(24))
    graphed = make_engine(model, cfg, **(ngram_engine_args() if speculative else {}))
    graphed.runner = GraphedRunner(graphed.runner, backend=LifetimeCheckBackend(), max_num_seqs=16)
    assert run(graphed, prompts, greedy(24)) == expected
    assert graphed.runner.num_replays > 10 and len(graphed.runner.graphs) > 1  # graphs replayed after others


def test_the_lifetime_check_names_a_freed_tensor():
    """The check can fail: a captured function read a tensor through an object that replaced it after the
    capture (the graph would go on reading the freed one); the tensor it reads now replays fine."""
    holder = SimpleNamespace(index=torch.arange(3))
    graph = LifetimeCheckBackend().capture(lambda: (torch.ones(4)[holder.index],))
    graph.replay()
    holder.index = torch.arange(3)
    with pytest.raises(AssertionError, match=r"holder\.index \(\[3\] torch.int64"):
        graph.replay()


@pytest.mark.parametrize("cfg", [TINY_QWEN3, TINY_GEMMA3], ids=["qwen3", "gemma3"])
def test_the_cuda_path_never_loads_the_cpu_kernels(cfg, monkeypatch):
    """A forward whose tensors are not on the CPU (the meta device stands in for CUDA here) never asks for
    the compiled kernels: no op calls `kernels.ops()` before checking its tensors (Gemma 3: a query past
    its sliding window, whose CPU path would cut the key rows on the host)."""
    def refuse():
        raise AssertionError("CPU kernels loaded on a non-CPU device")
    monkeypatch.setattr(kernels, "ops", refuse)
    model, _ = tiny_target(cfg)
    model = model.to("meta")
    caches = [(torch.empty(8, 4, 2, cfg.head_dim, device="meta"), torch.empty(8, 4, 2, cfg.head_dim, device="meta"))
              for _ in range(model.num_kv_layers)]
    meta = build_attn_metadata([SeqSpec(block_table=[0, 1, 2, 3], num_cached=12, num_query=1, token_offset=0)],
                               num_tokens=1, kv_block_size=4, device="meta")
    with torch.inference_mode():
        hidden, _ = model(torch.zeros(1, dtype=torch.long, device="meta"), torch.zeros(1, dtype=torch.long,
                                                                                        device="meta"),
                          meta, caches)
        logits = model.compute_logits(hidden)
    assert logits.shape == (1, cfg.vocab_size) and logits.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager_on_gpu():
    """The smallest case of the replay failure docs/parallel.md describes (a device-side assert in
    `vectorized_gather_kernel`: the graph gathered through `token_index` after its memory went back to the
    allocator): graphed greedy output equals eager on CUDA."""
    from dspark.worker.cuda_graphs import CudaGraphBackend
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    model = model.to("cuda", torch.bfloat16)
    prompts = repetitive_prompts(6, cfg.vocab_size, seed=3)
    eager = make_engine(model, cfg, device="cuda", dtype="bfloat16")
    expected = run(eager, prompts, greedy(24))
    graphed = make_engine(model, cfg, device="cuda", dtype="bfloat16")
    graphed.runner = GraphedRunner(graphed.runner, backend=CudaGraphBackend(), max_num_seqs=16)
    assert run(graphed, prompts, greedy(24)) == expected
    assert graphed.runner.num_replays > 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "verify"])
def test_cuda_graphs_replay_under_poison(speculative):
    """Right after each capture the allocator's free blocks hold out-of-range indices: a graph that reads a
    tensor freed after its capture (token_index before the fix) asserts or diverges at its first replay."""
    from dspark.worker.cuda_graphs import PoisonedCudaGraphBackend
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    model = model.to("cuda", torch.bfloat16)
    prompts = repetitive_prompts(6, cfg.vocab_size, seed=3)
    kw = lambda: ngram_engine_args() if speculative else {}  # noqa: E731 - a fresh drafter per engine
    expected = run(make_engine(model, cfg, device="cuda", dtype="bfloat16", **kw()), prompts, greedy(24))
    graphed = make_engine(model, cfg, device="cuda", dtype="bfloat16", **kw())
    graphed.runner = GraphedRunner(graphed.runner, backend=PoisonedCudaGraphBackend(), max_num_seqs=16)
    assert run(graphed, prompts, greedy(24)) == expected
    torch.cuda.synchronize()
    assert graphed.runner.num_replays > 10 and graphed.runner.backend.poison


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llm_on_cuda_with_graphs_equals_cpu_with_prompt_lookup(tmp_path):
    """The public path end to end: `LLM(..., device="cuda")`, eager and with CUDA graphs, with prompt-lookup
    speculation writes the CPU's greedy tokens."""
    from tiny_checkpoint import write_tiny_checkpoint

    from dspark.llm import LLM
    from dspark.sampling import SamplingParams
    model = write_tiny_checkpoint(tmp_path / "tiny")
    prompts = [list(range(1, 5 + i)) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    cpu = LLM(str(model), speculative_config=spec, max_num_seqs=16).generate(prompts, [params] * 8)
    for eager in (True, False):
        cuda = LLM(str(model), device="cuda", enforce_eager=eager, speculative_config=spec, max_num_seqs=16)
        assert [o.token_ids for o in cuda.generate(prompts, [params] * 8)] == [o.token_ids for o in cpu], eager
