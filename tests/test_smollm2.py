"""The real default model (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized to fp32):

* greedy output equals HF transformers (its own GGUF loading) token for token on 20 eval prompts,
  the engine running them 8 at a time with chunked prefill;
* speculative greedy output equals plain greedy output for every drafter — random-weight DSpark,
  DFlash (both slot layouts), EAGLE-3, a layer-truncated draft model, n-gram — with 8 concurrent
  requests, prompt chunks, prefix-cache hits and forced preemption. Zero mismatches.
"""

from __future__ import annotations

import pytest
import torch

from dspark.bench.datasets import load_prompts
from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.sampling import SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def chat_prompts(smollm2):
    _, _, tok = smollm2
    rows = load_prompts("all", num_prompts=20, seed=0)
    return [tok.apply_chat_template([{"role": "user", "content": r.prompt}])[:400] for r in rows]


def _engine(smollm2, *, spec=None, drafter=None, num_kv_blocks=2048, budget=256):
    model, cfg, tok = smollm2
    config = EngineConfig(cache=CacheConfig(kv_block_size=16, num_kv_blocks=num_kv_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
                          spec=spec)
    return Engine(config, model=model, model_config=cfg, drafter=drafter, eos_token_ids=tok.eos_token_ids)


def _generate(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.token_ids for o in LLM(engine=engine, tokenizer=None).generate(prompts, params)]


def test_greedy_equals_hf_transformers_on_20_eval_prompts(smollm2, hf_smollm2, chat_prompts):
    ours = _generate(_engine(smollm2), chat_prompts)
    eos = smollm2[1].eos_token_ids
    mismatches = []
    for i, prompt in enumerate(chat_prompts):
        with torch.inference_mode():
            out = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      eos_token_id=list(eos), pad_token_id=eos[0])
        ref = out[0, len(prompt):].tolist()
        if ours[i] != ref:
            mismatches.append((i, ours[i], ref))
    assert not mismatches, f"{len(mismatches)} of 20 prompts differ from HF greedy: {mismatches[:2]}"


@pytest.fixture(scope="module")
def plain_outputs(smollm2, chat_prompts):
    """Plain greedy, one request at a time: the reference for every concurrent run below."""
    engine = _engine(smollm2)
    return [_generate(engine, [p])[0] for p in chat_prompts[:8]]


def _random_dspark(tmp_path, smollm2, **kw):
    from dspark.drafters.dspark import save_dspark
    from dspark.drafters.dspark_config import dspark_config_for_target
    from dspark.drafters.dspark_model import DSparkModel
    _, cfg, _ = smollm2
    dcfg = dspark_config_for_target(cfg, num_hidden_layers=1, block_size=4, **kw)
    torch.manual_seed(0)
    model = DSparkModel(dcfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(1.0 + 0.05 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    save_dspark(model, dcfg, tmp_path / "drafter", dtype="float32")
    return str(tmp_path / "drafter")


def _random_eagle3(tmp_path, smollm2):
    from dspark.drafters.eagle3_model import Eagle3Config, Eagle3Model, save_eagle3
    _, cfg, _ = smollm2
    ecfg = Eagle3Config.from_target(cfg, num_draft_tokens=4)
    model = Eagle3Model(ecfg).init_weights(seed=0)
    save_eagle3(model, ecfg, str(tmp_path / "eagle3"))
    return str(tmp_path / "eagle3")


SPECS = {
    "none": lambda tmp, s: None,  # plain decoding under the same pressure: chunks, hits, preemption
    "ngram": lambda tmp, s: SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1),
    "draft_model": lambda tmp, s: SpecConfig(method="draft_model", draft_num_layers=24,
                                             num_speculative_tokens=4),
    "dspark": lambda tmp, s: SpecConfig(method="dspark", num_speculative_tokens=4,
                                        model=_random_dspark(tmp, s, markov_rank=16)),
    "dflash": lambda tmp, s: SpecConfig(method="dflash", num_speculative_tokens=4,
                                        model=_random_dspark(tmp, s)),
    "dflash_zlab": lambda tmp, s: SpecConfig(method="dflash", num_speculative_tokens=3,
                                             model=_random_dspark(tmp, s, slot_layout="zlab")),
    "eagle3": lambda tmp, s: SpecConfig(method="eagle3", num_speculative_tokens=4,
                                        model=_random_eagle3(tmp, s)),
}


@pytest.mark.parametrize("method", list(SPECS))
def test_speculative_greedy_equals_plain(method, smollm2, chat_prompts, plain_outputs, tmp_path):
    model, cfg, _ = smollm2
    spec = SPECS[method](tmp_path, smollm2)
    drafter = None if spec is None else build_drafter(spec, target_config=cfg, target_model=model,
                                                      dtype=torch.float32, device="cpu")
    # 8 concurrent requests, 64-token budget (prompt chunks share steps with verify windows), a pool
    # too small for all of them (preemption), and the prompts share the chat-template prefix (hits)
    engine = _engine(smollm2, spec=spec, drafter=drafter, num_kv_blocks=48, budget=64)
    outs = _generate(engine, chat_prompts[:8])
    mismatches = [i for i, (a, b) in enumerate(zip(outs, plain_outputs)) if a != b]
    assert not mismatches, f"{method}: prompts {mismatches} differ from plain greedy"
    assert engine.metrics.num_preemptions > 0, "the 48-block pool must force preemption"
    assert engine.metrics.num_drafts > 0 or spec is None, "the drafter never proposed"
    assert engine.block_manager.num_free_blocks == 48
    if method == "draft_model":
        assert engine.metrics.num_accepted_tokens > 0


def test_shipped_default_greedy_equals_plain(smollm2, chat_prompts, plain_outputs):
    """What `dspark serve` runs with no --speculative-config: the trained DSpark drafter, prompt lookup
    first, the prefix scheduler on the shipped cost table (draft gate on) — same pressure as above."""
    from dspark.drafters.shipped import default_spec_config
    from dspark.engine.build import build_policy
    model, cfg, tok = smollm2
    spec = default_spec_config("SmolLM2-135M-Instruct")
    assert spec is not None and spec.ngram_first and spec.length_policy == "prefix"
    drafter = build_drafter(spec, target_config=cfg, target_model=model, dtype=torch.float32, device="cpu")
    config = EngineConfig(cache=CacheConfig(kv_block_size=16, num_kv_blocks=40),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), spec=spec)
    policy, cost = build_policy(config, drafter)
    engine = Engine(config, model=model, model_config=cfg, drafter=drafter, length_policy=policy,
                    cost_table=cost, eos_token_ids=tok.eos_token_ids)
    outs = _generate(engine, chat_prompts[:8])
    mismatches = [i for i, (a, b) in enumerate(zip(outs, plain_outputs)) if a != b]
    assert not mismatches, f"shipped default: prompts {mismatches} differ from plain greedy"
    assert engine.metrics.num_preemptions > 0
    assert engine.metrics.num_lookup_drafts > 0, "the lookup must draft"
    assert drafter.model_expected[True] is not None, "the model must draft (its running record exists)"
    assert engine.metrics.num_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == 40


@pytest.fixture(scope="module")
def smollm2_bf16():
    """The default model with bf16 matrix products (`--matmul-dtype bfloat16`, the default where the CPU
    kernels multiply bf16)."""
    from dspark import kernels
    from dspark.models.loader import DEFAULT_MODEL, load_model
    if not kernels.has_bf16_kernels():
        pytest.skip("no AVX512-BF16 CPU kernels")
    return load_model(DEFAULT_MODEL, dtype=torch.float32, matmul_dtype="bfloat16")


def test_bf16_products_shipped_default_greedy_equals_plain(smollm2_bf16, chat_prompts, hf_smollm2):
    """Lossless with bf16 products too: plain decoding of the bf16 model against the shipped default on
    its bf16 cost table, under the pressure above (preemption, prompt chunks sharing verify steps); and
    the bf16 model stays the model — its greedy tokens against HF's fp32 agree on most of the prompts."""
    from dspark.drafters.shipped import default_spec_config
    from dspark.engine.build import build_policy
    model, cfg, tok = smollm2_bf16
    plain = _generate(_engine(smollm2_bf16, num_kv_blocks=48, budget=64), chat_prompts[:8])
    spec = default_spec_config("SmolLM2-135M-Instruct", matmul_dtype="bfloat16")
    assert spec.cost_table.endswith("cost_table_bf16.json")
    drafter = build_drafter(spec, target_config=cfg, target_model=model, dtype=torch.float32, device="cpu")
    config = EngineConfig(cache=CacheConfig(kv_block_size=16, num_kv_blocks=40), matmul_dtype="bfloat16",
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), spec=spec)
    policy, cost = build_policy(config, drafter)
    assert cost.meta["matmul_dtype"] == "bfloat16"
    engine = Engine(config, model=model, model_config=cfg, drafter=drafter, length_policy=policy,
                    cost_table=cost, eos_token_ids=tok.eos_token_ids)
    outs = _generate(engine, chat_prompts[:8])
    mismatches = [i for i, (a, b) in enumerate(zip(outs, plain)) if a != b]
    assert not mismatches, f"bf16 shipped default: prompts {mismatches} differ from bf16 plain greedy"
    assert engine.metrics.num_preemptions > 0 and engine.metrics.num_accepted_tokens > 0
    eos = cfg.eos_token_ids
    same = 0
    for prompt, ours in zip(chat_prompts[:8], plain):
        with torch.inference_mode():
            out = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      eos_token_id=list(eos), pad_token_id=eos[0])
        same += ours == out[0, len(prompt):].tolist()
    assert same >= 6, f"only {same} of 8 bf16 greedy outputs equal HF fp32's"
