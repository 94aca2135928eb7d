"""Warm start of a block drafter from the target (TrainConfig warm_start "target", dspark/train/warm_start.py):
at step 0 the named draft layers hold the target layers' weights (q/k/v and gate/up unfused from the target's
merged projections, q/k norms of a Qwen3 target), fc is the identity on the deepest tap and zero elsewhere,
hidden_norm is the first copied layer's input norm; the heads keep their random start; every copied tensor
is a trainable copy, not an alias. Bad settings are refused naming the key.

    pytest tests/test_warm_start.py -q
"""

from __future__ import annotations

import pytest
import torch

from dspark.train import methods
from dspark.train.config import TrainConfig
from dspark.train.warm_start import target_layer_weights
from test_dspark_drafter import TAPS, TARGET, random_target


def _cfg(**kw) -> TrainConfig:
    base = dict(method="dspark", num_draft_layers=2, block_size=4, tap_layer_ids=TAPS, markov_rank=8,
                draft_vocab_size=None, warm_start="target")
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("layers,expect", [(None, (2, 3)), ((0, 2), (0, 2))])
def test_named_layers_equal_the_targets_at_step_zero(layers, expect):
    target = random_target(seed=3)
    model, dcfg = methods.build(_cfg(warm_start_layers=layers), target, TARGET, None)
    params = dict(model.named_parameters())
    for i, tid in enumerate(expect):
        source = target_layer_weights(target.model.layers[tid])
        assert set(source) >= {"self_attn.q_proj.weight", "mlp.up_proj.weight", "self_attn.k_norm.weight"}
        for name, w in source.items():
            mine = params[f"layers.{i}.{name}"]
            assert torch.equal(mine, w), f"layers.{i}.{name} != target layer {tid}"
            assert mine.requires_grad and mine.data_ptr() != w.data_ptr()
    d = TARGET.hidden_size
    deepest = TAPS.index(max(TAPS))
    fc = model.fc.weight
    assert torch.equal(fc[:, deepest * d:(deepest + 1) * d], torch.eye(d))
    assert fc[:, :deepest * d].abs().sum() == 0 and fc[:, (deepest + 1) * d:].abs().sum() == 0
    assert torch.equal(model.hidden_norm.weight, target.model.layers[expect[0]].input_layernorm.weight)
    assert torch.equal(model.norm.weight, target.model.norm.weight)
    # the heads are not the target's: random, as without a warm start
    cold, _ = methods.build(_cfg(warm_start="none"), target, TARGET, None)
    assert torch.equal(model.markov_head.markov_w1.weight, cold.markov_head.markov_w1.weight)
    assert not torch.equal(model.layers[0].self_attn.q_proj.weight, cold.layers[0].self_attn.q_proj.weight)


def test_warm_start_settings_are_checked():
    with pytest.raises(ValueError, match="warm_start 'bogus' unknown"):
        _cfg(warm_start="bogus")
    with pytest.raises(ValueError, match="not eagle3"):
        TrainConfig(method="eagle3", warm_start="target")
    with pytest.raises(ValueError, match="warm_start_layers needs"):
        _cfg(warm_start="none", warm_start_layers=(0, 1))
    target = random_target()
    with pytest.raises(ValueError, match="name 1 layers; the drafter has 2"):
        methods.build(_cfg(warm_start_layers=(1,)), target, TARGET, None)
    with pytest.raises(ValueError, match=r"outside the target's 4 layers"):
        methods.build(_cfg(warm_start_layers=(1, 9)), target, TARGET, None)
