"""Shared helpers for the DSpark drafter tests (test_dspark_drafter.py, test_dspark_drafter_dtypes.py,
test_draft_topk.py): a
scaled-down Qwen3 target config with its taps, random drafter and target weights, a NaN-filled drafter KV
pool, the speculative config and propose request the tests build, and a greedy engine run for parity.
"""


from __future__ import annotations


import torch


from dspark.config import SpecConfig
from dspark.drafters.base import ProposeRequest
from dspark.drafters.dspark import DSparkDrafter
from dspark.drafters.dspark_config import DSparkConfig, dspark_config_for_target
from dspark.drafters.dspark_model import DSparkModel
from dspark.models import build_model
from dspark.models.config import ModelConfig
from dspark.sampling import SamplingParams

ATOL = 1e-4
TARGET = ModelConfig(
    architecture="Qwen3ForCausalLM", vocab_size=128, hidden_size=32, intermediate_size=48,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False, qk_norm=True,
    bos_token_id=1, eos_token_ids=(2,))
TAPS = (-1, 0, 2)


def tiny_cfg(**overrides) -> DSparkConfig:
    kw = dict(num_hidden_layers=2, block_size=4, tap_layer_ids=TAPS, markov_rank=8,
              markov_head_type="vanilla", mask_token_id=127)
    kw.update(overrides)
    return dspark_config_for_target(TARGET, **kw)


def random_model(cfg: DSparkConfig, seed: int = 0) -> DSparkModel:
    torch.manual_seed(seed)
    model = DSparkModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norms, so a missed one shows
            else:
                p.normal_(0.0, 0.3)
    return model.eval()


def random_target(seed: int = 0):
    torch.manual_seed(seed)
    target = build_model(TARGET)
    with torch.no_grad():
        for name, p in target.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return target


def make_pool(drafter: DSparkDrafter, *, num_blocks: int, kv_block_size: int):
    """NaN everywhere (a stray read shows) except slot 0, the gather padding (a real pool is zeroed)."""
    pool = []
    for heads, dim in drafter.kv_layer_specs():
        k = torch.full((num_blocks, kv_block_size, heads, dim), float("nan"))
        v = torch.full((num_blocks, kv_block_size, heads, dim), float("nan"))
        k[0, 0] = 0.0
        v[0, 0] = 0.0
        pool.append((k, v))
    drafter.bind_kv(pool)


def propose_request(rid, ids, anchor_pos, table, params=SamplingParams(temperature=0.0), gen=None):
    return ProposeRequest(request_id=rid, all_ids=list(ids[:anchor_pos + 1]), anchor_pos=anchor_pos,
                          block_table=table, num_draft_computed=anchor_pos, params=params, generator=gen)



def spec(path, *, method="dspark", n=4, **kw):
    return SpecConfig(method=method, model=str(path), num_speculative_tokens=n, **kw)


PARITY_PROMPTS = [[1, 17, 33, 60, 5, 9, 88, 21, 40], [1, 90, 4], list(range(3, 40))]


def greedy_engine_run(target, spec_config: SpecConfig | None, prompts=PARITY_PROMPTS):
    """Greedy outputs (16 tokens each, EOS ignored) of `prompts` through an Engine over `target` with the
    drafter `spec_config` builds (None: plain decoding), and the engine (its metrics and drafter)."""
    from dspark.config import CacheConfig, EngineConfig, SchedulerConfig
    from dspark.drafters.dspark import build
    from dspark.engine.engine import Engine

    config = EngineConfig(spec=spec_config, cache=CacheConfig(kv_block_size=4, num_kv_blocks=96),
                          scheduler=SchedulerConfig(max_num_batched_tokens=24))
    drafter = None if spec_config is None else build(spec_config, target_config=TARGET, target_model=target,
                                                     dtype=torch.float32, device="cpu")
    engine = Engine(config, model=target, model_config=TARGET, drafter=drafter)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)) for p in prompts]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in ids], engine
