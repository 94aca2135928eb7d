"""Speculation at long contexts stays lossless: a tiny Qwen3-shaped target serving 4k- and 8k-token prompts, chunked
across steps while a short request decodes beside them (drafting between the chunks), gives the greedy output of
plain decoding with prompt lookup, a layer-truncated draft model, EAGLE-3, and DSpark and DFlash with a context
window that cuts the context (`draft_context_window`) and DSpark without one.
Run: pytest tests/test_long_context.py -q"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters import build_drafter
from dspark.drafters.dspark import save_dspark
from dspark.drafters.dspark_config import dspark_config_for_target
from dspark.engine.engine import Engine
from dspark.models import build_model
from dspark.sampling import SamplingParams
from tests.dspark_helpers import TARGET, random_model

LONG = dataclasses.replace(TARGET, max_position_embeddings=8448)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    model = build_model(LONG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def _prompts(length: int) -> list[list[int]]:
    """A long prompt that repeats stretches of itself (prompt lookup finds them), and a short one."""
    g = torch.Generator().manual_seed(length)
    base = torch.randint(3, 120, (200,), generator=g).tolist()
    long = [1] + [base[i * 7 % 200] for i in range(length - 1)]  # a 200-token cycle
    return [long, [1, 5, 9, 33, 60, 5, 9]]


def _run(target, spec: SpecConfig | None, prompts: list[list[int]]) -> tuple[list[list[int]], Engine]:
    config = EngineConfig(spec=spec, cache=CacheConfig(kv_block_size=16, num_kv_blocks=600),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=8448))
    drafter = None if spec is None else build_drafter(spec, target_config=LONG, target_model=target,
                                                      dtype=torch.float32, device="cpu")
    engine = Engine(config, model=target, model_config=LONG, drafter=drafter)
    short = engine.add_request(prompts[1], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    engine.step()  # the short one decodes (and drafts) while the long prompt's chunks go in
    long = engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    out = {short: [], long: []}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[long], out[short]], engine


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, target):
    from dspark.drafters.eagle3 import Eagle3Config, Eagle3Model, bind_to_target, save_eagle3
    cfg = Eagle3Config.from_target(LONG, tap_layer_ids=(-1, 0, 2), num_draft_tokens=4)
    model = bind_to_target(Eagle3Model(cfg).init_weights(std=0.15, seed=1), target).eval()
    path = tmp_path_factory.mktemp("eagle3")
    save_eagle3(model, model.config, str(path))
    return path


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    cfg = dspark_config_for_target(LONG, num_hidden_layers=2, block_size=4, tap_layer_ids=(-1, 0, 2), markov_rank=8,
                                   markov_head_type="vanilla", mask_token_id=127)
    path = tmp_path_factory.mktemp("drafter") / "d"
    save_dspark(random_model(cfg, seed=3), cfg, path, dtype="float32")
    return path


@pytest.mark.parametrize("length", [4096, 8192])
def test_greedy_speculation_equals_plain_at_long_contexts(target, drafter_dir, eagle3_dir, length):
    prompts = _prompts(length)
    plain, _ = _run(target, None, prompts)
    specs = {
        "ngram": SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4),
        "draft_model": SpecConfig(method="draft_model", draft_num_layers=1, num_speculative_tokens=3),
        "dspark_window": SpecConfig(method="dspark", model=str(drafter_dir), num_speculative_tokens=4,
                                    draft_context_window=256),
        "dspark_whole": SpecConfig(method="dspark", model=str(drafter_dir), num_speculative_tokens=4,
                                   draft_context_window=0),
        "dflash_window": SpecConfig(method="dflash", model=str(drafter_dir), num_speculative_tokens=4,
                                    draft_context_window=256),
        "eagle3": SpecConfig(method="eagle3", model=str(eagle3_dir), num_speculative_tokens=3),
    }
    for name, spec in specs.items():
        got, engine = _run(target, spec, prompts)
        assert got == plain, name
        assert engine.metrics.num_drafts > 0, f"{name} never drafted"
        assert not engine.requests and engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
