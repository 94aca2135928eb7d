"""End-to-end engine tests on tiny random targets: greedy output equals HF transformers; 8
concurrent requests with chunked prefill, prefix-cache hits and forced preemption equal one at a time;
speculative greedy output equals plain greedy for the n-gram drafter; KV blocks all return."""

from __future__ import annotations

import pytest

from dspark.config import SpecConfig
from dspark.drafters.ngram import NgramDrafter
from dspark.llm import LLM
from dspark.sampling import SamplingParams
from tests.conftest import TINY_LLAMA, TINY_QWEN3
from tests.engine_helpers import (greedy, hf_greedy, make_engine, repetitive_prompts, run,
                                  run_one_at_a_time, tiny_target)


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_QWEN3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("decode_layout", [False, True], ids=["out_in", "decode_layout"])
def test_greedy_equals_hf_transformers(cfg, decode_layout):
    from dspark.models.layers import add_decode_layout
    model, hf = tiny_target(cfg)
    if decode_layout:  # one-row products read the transposed copies (batch-1 decode fast path)
        assert add_decode_layout(model) > 0
    engine = make_engine(model, cfg)
    prompts = repetitive_prompts(4, cfg.vocab_size, seed=1)
    ours = run_one_at_a_time(engine, prompts, greedy(24))
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 24)
    assert engine.block_manager.num_free_blocks == 256


def test_concurrent_chunked_prefix_preemption_equals_sequential():
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(8, cfg.vocab_size, seed=2)
    reference = run_one_at_a_time(make_engine(model, cfg, prefix=False), prompts, greedy(30))
    # budget 16 → prompts are chunked and share steps with decodes; 40 blocks of 4 slots for 8
    # requests of up to ~70 tokens → preemption is forced; shared prefixes → prefix-cache hits
    engine = make_engine(model, cfg, num_kv_blocks=40, budget=16)
    outs = run(engine, prompts, greedy(30))
    assert outs == reference
    assert engine.metrics.num_preemptions > 0, "the small pool must force preemption"
    assert engine.block_manager.num_free_blocks == 40
    engine.block_manager.check_invariants()


def test_prefix_cache_hit_gives_same_tokens():
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    engine = make_engine(model, cfg)
    prompt = repetitive_prompts(1, cfg.vocab_size, seed=3, length=38)[0]
    llm = LLM(engine=engine, tokenizer=None)
    first = llm.generate([prompt], greedy(12))[0]
    second = llm.generate([prompt], greedy(12))[0]  # reuses the committed full blocks
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 36
    assert second.token_ids == first.token_ids
    # a request that finishes in the step that completes its prompt (one token) registers it too
    other = repetitive_prompts(1, cfg.vocab_size, seed=5, length=38)[0]
    llm.generate([other], greedy(1))
    assert llm.generate([other], greedy(3))[0].num_cached_tokens == 36


def _ngram_engine(model, cfg, **kw):
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    return make_engine(model, cfg, drafter=NgramDrafter(num_draft_tokens=4, prompt_lookup_min=1,
                                                        prompt_lookup_max=3), spec=spec, **kw)


def test_ngram_speculative_greedy_equals_plain_batch1():
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(4, cfg.vocab_size, seed=4)
    plain = run_one_at_a_time(make_engine(model, cfg), prompts, greedy(32))
    engine = _ngram_engine(model, cfg)
    spec = run_one_at_a_time(engine, prompts, greedy(32))
    assert spec == plain
    m = engine.metrics
    assert m.num_drafts > 0 and m.num_accepted_tokens > 0, "the n-gram drafter must get drafts accepted"


def test_ngram_speculative_concurrent_with_preemption_equals_plain():
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(8, cfg.vocab_size, seed=5)
    plain = run_one_at_a_time(make_engine(model, cfg), prompts, greedy(30))
    engine = _ngram_engine(model, cfg, num_kv_blocks=48, budget=20)
    outs = run(engine, prompts, greedy(30))
    assert outs == plain
    assert engine.metrics.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 48


def test_per_request_speculation_opt_out_and_mixed_greedy_sampled():
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(4, cfg.vocab_size, seed=6)
    plain = run_one_at_a_time(make_engine(model, cfg), prompts, greedy(20))
    engine = _ngram_engine(model, cfg)
    drafted = []  # the ids of every request a proposal drafted for
    propose = engine.drafter.propose

    def recorded_propose(batch):
        out = propose(batch)
        num_valid = out.num_valid or [out.draft_ids.shape[1]] * len(batch.requests)
        drafted.extend(tuple(r.all_ids) for r, n in zip(batch.requests, num_valid) if n > 0)
        return out
    engine.drafter.propose = recorded_propose
    params = [greedy(20), greedy(20, speculation=False), greedy(20),
              SamplingParams(temperature=1.0, max_tokens=20, seed=7, ignore_eos=True)]
    outs = run(engine, prompts, params)
    assert outs[:3] == plain[:3]
    assert len(outs[3]) == 20
    # the opted-out request is never drafted for; the others are
    drafted_for = [any(ids[:len(p)] == tuple(p) for ids in drafted) for p in prompts]
    assert not drafted_for[1], "a request with speculation=False was drafted for"
    assert drafted_for[0] and drafted_for[2]
    # a seeded sampled request is reproducible on its own
    again = run(_ngram_engine(model, cfg), [prompts[3]], params[3])[0]
    assert again == outs[3]


def test_eos_inside_accepted_run_ends_output_where_plain_does():
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    prompts = repetitive_prompts(4, cfg.vocab_size, seed=8)
    plain_free = run_one_at_a_time(make_engine(model, cfg), prompts, greedy(30))
    # pick, per prompt, a token that occurs mid-output as the stop token
    for p, out in zip(prompts, plain_free):
        stop = out[len(out) // 2]
        params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop,))
        plain = run(make_engine(model, cfg), [p], params)[0]
        spec = run(_ngram_engine(model, cfg), [p], params)[0]
        assert spec == plain == out[:out.index(stop) + 1]


def test_bad_requests_rejected():
    cfg = TINY_LLAMA
    model, _ = tiny_target(cfg)
    engine = make_engine(model, cfg)
    with pytest.raises(ValueError, match="maximum model length"):
        engine.add_request(list(range(3, 3 + cfg.max_position_embeddings)), greedy(4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5, cfg.vocab_size + 3], greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], greedy(4))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
