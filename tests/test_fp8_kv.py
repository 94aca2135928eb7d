"""`--kv-cache-dtype fp8` (e4m3) / `fp8_e5m2`: the target's K/V stored in 8 bits and upcast in attention.
Prompt logprobs against full-precision KV within a stated bound (tiny Llama, Qwen3 and Gemma 3, prompts
longer than a chunk), greedy speculative output equal to plain fp8 output and batch 1 equal to batch 8 (tiny Llama,
Gemma 3, Gemma 4 and Qwen3.5, and the default model with its Q4_1 products), the pool's capacity for the same
bytes (x4 against fp32), the fused CPU stacks left out for an 8-bit pool, and the checks on the flag and on
`--gpu-memory-utilization` (CUDA's pool sizing, refused on the CPU naming the flag that sizes it there)."""

from __future__ import annotations

import pytest
import torch

from dspark import kernels

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig
from dspark.engine.engine import Engine
from dspark.worker.model_runner import pool_bytes
from dspark.llm import LLM
from dspark.sampling import SamplingParams
from tests.conftest import TINY_GEMMA3, TINY_LLAMA, TINY_QWEN3
from tests.engine_helpers import greedy, make_engine, ngram_engine_args, repetitive_prompts, tiny_target

# prompt-logprob bound (nats) against fp32 KV, with margin over what these configs show (0.025 / 0.054)
BOUND = {"fp8": 0.05, "fp8_e5m2": 0.1}


def _engine(model, cfg, kv: str, *, blocks: int | None = 128, memory: int = 2**30, **kw) -> Engine:
    config = EngineConfig(model="tiny", cache=CacheConfig(kv_block_size=4, num_kv_blocks=blocks,
                                                          kv_cache_memory_bytes=memory, kv_cache_dtype=kv),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16), spec=kw.pop("spec", None))
    return Engine(config, model=model, model_config=cfg, **kw)


def _run(engine, prompts, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **kw)
    return LLM(engine=engine, tokenizer=None).generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_QWEN3, TINY_GEMMA3], ids=["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_prompt_logprobs_within_the_bound_of_full_precision(cfg, kv):
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(3, cfg.vocab_size, seed=1, length=40)
    full, low = (_run(_engine(model, cfg, k), prompts, prompt_logprobs=0) for k in ("auto", kv))
    diffs = [abs(a.logprob - b.logprob) for x, y in zip(full, low)
             for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])]
    assert 0 < max(diffs) < BOUND[kv]  # 8-bit K/V do change the numbers, within the bound
    engine = _engine(model, cfg, kv)
    assert engine.runner.kv_caches[0][0].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_speculative_greedy_equals_plain_with_fp8_kv(kv):
    cfg = TINY_QWEN3
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(6, cfg.vocab_size, seed=2)
    plain = _run(_engine(model, cfg, kv), prompts)
    spec_engine = _engine(model, cfg, kv, **ngram_engine_args())
    spec = _run(spec_engine, prompts)
    assert spec_engine.metrics.num_drafts > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_engine.block_manager.num_free_blocks == 128


def test_the_same_bytes_hold_four_times_the_tokens_of_fp32():
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    blocks = {kv: _engine(model, cfg, kv, blocks=None, memory=100 * 3072).block_manager.num_free_blocks
              for kv in ("auto", "fp8", "fp8_e5m2")}
    assert blocks["auto"] == 100 and blocks["fp8"] == blocks["fp8_e5m2"] == 400  # a block: 3 layers, K and V, 4 x 2 x 16


def test_an_fp8_pool_never_takes_the_fused_cpu_stack(monkeypatch):
    """The one-call decoder stacks read fp32 pools: an 8-bit pool runs the per-layer torch path."""
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    calls = []
    monkeypatch.setattr(kernels, "decoder_layers", lambda *a, **kw: calls.append(1) or False)
    _run(_engine(model, cfg, "fp8"), repetitive_prompts(2, cfg.vocab_size, seed=3))
    assert calls == []


def test_flags_are_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        EngineConfig(device="cpu", cache=CacheConfig(gpu_memory_utilization=0.9))


def test_gpu_memory_utilization_sizes_the_pool_from_what_the_weights_leave():
    gib = 2**30
    cache = CacheConfig(gpu_memory_utilization=0.9)
    # 80 GiB device, 10 GiB in use (weights): 72 - 10 = 62 GiB for the pool
    assert pool_bytes(cache, "cuda", mem_get_info=lambda d: (70 * gib, 80 * gib)) == 62 * gib
    with pytest.raises(ValueError, match="leaves no memory"):
        pool_bytes(CacheConfig(gpu_memory_utilization=0.1), "cuda", mem_get_info=lambda d: (70 * gib, 80 * gib))
    assert pool_bytes(CacheConfig(kv_cache_memory_bytes=123), "cpu") == 123


def _tiny_families():
    from tests.test_gemma4 import DENSE, target as gemma4_target
    from tests.test_hybrid import TINY_QWEN3_5
    return {"llama": lambda: tiny_target(TINY_LLAMA) + (TINY_LLAMA,),
            "gemma3": lambda: tiny_target(TINY_GEMMA3) + (TINY_GEMMA3,),
            "gemma4": lambda: gemma4_target(DENSE) + (DENSE,),
            "qwen3_5": lambda: tiny_target(TINY_QWEN3_5) + (TINY_QWEN3_5,)}


def _bits(outs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


# families whose fp32 path is batch-invariant bit for bit; Gemma 4 and the hybrid are so to the token only (their
# per-layer inputs and batched recurrence round differently by row count whatever the KV dtype)
BITWISE = {"llama": True, "gemma3": True, "gemma4": False, "qwen3_5": False}


# batch invariance is the CPU attention kernel's (each query on its own); without the kernels attention is one
# padded SDPA per group, invariant for no KV dtype, so these hold where the kernels are built
NEEDS_KERNELS = pytest.mark.skipif(not kernels.enabled(), reason="batch invariance needs the CPU attention kernel")


@NEEDS_KERNELS
@pytest.mark.parametrize("family", list(BITWISE))
def test_fp8_results_do_not_depend_on_the_batch_or_on_speculation(family):
    """Batch 1 == batch 8 (bit for bit, tokens and their logprobs, where the fp32 pool is so) and greedy speculative
    == plain: an 8-bit pool's attention computes each query on its own as the fp32 one does, not as one padded
    product over the batch."""
    model, _, cfg = _tiny_families()[family]()
    prompts = [p[:9 + 5 * i] for i, p in enumerate(repetitive_prompts(8, cfg.vocab_size, seed=4, length=48))]
    params = greedy(12, logprobs=0)
    plain = make_engine(model, cfg, kv_cache_dtype="fp8", budget=48)
    alone = _bits(LLM(engine=plain, tokenizer=None).generate([p], params, use_tqdm=False)[0] for p in prompts)
    together = _bits(LLM(engine=plain, tokenizer=None).generate(prompts, params, use_tqdm=False))
    assert [t for t, _ in together] == [t for t, _ in alone]
    if BITWISE[family]:
        assert together == alone
    spec_engine = make_engine(model, cfg, kv_cache_dtype="fp8", budget=48, **ngram_engine_args())
    spec = [o.token_ids for o in LLM(engine=spec_engine, tokenizer=None).generate(prompts, greedy(12), use_tqdm=False)]
    assert spec_engine.metrics.num_drafts > 0
    assert spec == [t for t, _ in alone]


@NEEDS_KERNELS
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_default_model_fp8_batch_invariant_and_speculation_lossless(smollm2, kv):
    """The default model's own weights (Q4_1 products): 5 prompts together == each alone, and its default drafting
    and prompt lookup == plain, with an 8-bit pool."""
    from dspark.config import DEFAULT_MODEL
    prompts = ["Explain photosynthesis in two sentences.", "Write a Python function that reverses a string.",
               "What is 17 * 23? Show your steps.", "List three facts about the Moon.", "Tell me a short story."]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=48)

    def outputs(llm, batch):
        return [o.outputs[0].token_ids for o in llm.chat(batch, params, use_tqdm=False)]

    plain = LLM(model=DEFAULT_MODEL, kv_cache_dtype=kv, speculative_config=None)
    alone = [outputs(plain, [m])[0] for m in messages]
    assert outputs(plain, messages) == alone
    for spec in ("default", {"method": "ngram", "num_speculative_tokens": 4}):
        kw = {} if spec == "default" else {"speculative_config": spec}
        assert outputs(LLM(model=DEFAULT_MODEL, kv_cache_dtype=kv, **kw), messages) == alone
