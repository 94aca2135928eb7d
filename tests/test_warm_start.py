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


# -- growing a warm start (TrainConfig init_grow: methods.copy_trainable grow)

def _same_blocks(src, grown, *, seed: int, anchors: list[list[int]]):
    """Both drafters' teacher-forced blocks over random taps and ids: base logits, Markov-corrected logits and
    (with a confidence head) confidences must agree. Returns the grown drafter's output (for a backward)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (2, 12), generator=g)
    taps = torch.randn(2, 12, len(TAPS) * TARGET.hidden_size, generator=g)
    a = src.training_forward(taps=taps, input_ids=ids, anchor_positions=torch.tensor(anchors))
    b = grown.training_forward(taps=taps, input_ids=ids, anchor_positions=torch.tensor(anchors))
    assert torch.allclose(a.base_logits, b.base_logits, atol=1e-5)
    assert torch.allclose(a.draft_logits, b.draft_logits, atol=1e-5)
    assert (a.confidence_logits is None) == (b.confidence_logits is None)
    if a.confidence_logits is not None:
        assert torch.allclose(a.confidence_logits, b.confidence_logits, atol=1e-5)
    return b


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_grown_drafter_computes_the_source_at_step_zero(method):
    """A 1-layer drafter grown to 3: layer 0 is the source's, layers 1-2 copy it with o_proj / down_proj at
    zero, every other trainable tensor is the source's, and the block logits (base, Markov-corrected) and
    confidences equal the source's; the grown projections still get gradients."""
    target = random_target(seed=5)
    extra = dict(markov_rank=8) if method == "dspark" else dict(markov_rank=0, loss_l1=0, loss_confidence=0)
    src, _ = methods.build(_cfg(method=method, num_draft_layers=1, warm_start="none", **extra), target, TARGET, None)
    with torch.no_grad():  # o_proj / down_proj away from their init, so a zero copy is not the init by chance
        for p in src.parameters():
            p.add_(0.05 * torch.randn_like(p)) if p.requires_grad else None
    grown, _ = methods.build(_cfg(method=method, num_draft_layers=3, warm_start="none", seed=9, **extra),
                             target, TARGET, None)
    methods.copy_trainable(src, grown, where="src", grow=True)
    have = dict(src.named_parameters())
    for name, p in grown.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith(("layers.1.", "layers.2.")):
            suffix = name.split(".", 2)[2]
            want = torch.zeros_like(p) if suffix in methods.GROWN_ZERO else have[f"layers.0.{suffix}"]
        else:
            want = have[name]
        assert torch.equal(p, want), name
    _same_blocks(src, grown, seed=1, anchors=[[0, 5, 8], [3, -1, 7]]).draft_logits.sum().backward()
    assert grown.layers[2].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert grown.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0


def test_growing_is_checked():
    with pytest.raises(ValueError, match="init_grow needs init_from"):
        _cfg(warm_start="none", init_grow=True)
    with pytest.raises(ValueError, match="init_grow needs"):
        TrainConfig(method="eagle3", init_from="x", init_grow=True)
    target = random_target()
    deep, _ = methods.build(_cfg(warm_start="none", num_draft_layers=3), target, TARGET, None)
    shallow, _ = methods.build(_cfg(warm_start="none", num_draft_layers=1), target, TARGET, None)
    with pytest.raises(ValueError, match="3 draft layers; growing needs 1 .. 1"):
        methods.copy_trainable(deep, shallow, where="deep", grow=True)
    with pytest.raises(ValueError, match=r"layers\.1\..* is missing"):  # without growing, depths must agree
        methods.copy_trainable(shallow, deep, where="shallow")
    big, _ = methods.build(_cfg(warm_start="none", markov_rank=8), target, TARGET, None)
    small, _ = methods.build(_cfg(warm_start="none", markov_rank=4), target, TARGET, None)
    with pytest.raises(ValueError, match=r"markov_w1\.weight is shape \[128, 8\]"):  # a smaller rank never fits
        methods.copy_trainable(big, small, where="big", grow=True)


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_grown_markov_rank_drafts_the_same_at_step_zero(head):
    """Rank 8 grown to 16 (and 1 layer to 2): W1's first 8 columns are the source's, W2's and the confidence
    head's new columns zero, so base, corrected logits and confidences equal the source's; W2's new columns get
    gradients. A gated head (rank-shaped state of its own) is refused."""
    target = random_target(seed=6)
    src, _ = methods.build(_cfg(warm_start="none", num_draft_layers=1, markov_rank=8, markov_head_type=head),
                           target, TARGET, None)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.05 * torch.randn_like(p)) if p.requires_grad else None
    grown, _ = methods.build(_cfg(warm_start="none", num_draft_layers=2, markov_rank=16, markov_head_type=head,
                                  seed=4), target, TARGET, None)
    if head == "gated":
        with pytest.raises(ValueError, match="markov_head"):
            methods.copy_trainable(src, grown, where="src", grow=True)
        return
    methods.copy_trainable(src, grown, where="src", grow=True)
    w1, w2 = grown.markov_head.markov_w1.weight, grown.markov_head.markov_w2.weight
    assert torch.equal(w1[:, :8], src.markov_head.markov_w1.weight) and w1[:, 8:].abs().sum() > 0
    assert torch.equal(w2[:, :8], src.markov_head.markov_w2.weight) and w2[:, 8:].abs().sum() == 0
    conf = grown.confidence_head.proj.weight
    assert torch.equal(conf[:, :TARGET.hidden_size + 8], src.confidence_head.proj.weight) and conf[:, -8:].abs().sum() == 0
    _same_blocks(src, grown, seed=2, anchors=[[0, 4, 8], [2, 6, -1]]).draft_logits.sum().backward()
    assert w2.grad[:, 8:].abs().sum() > 0


def test_grown_anchor_features_start_at_zero_and_learn():
    """anchor_features added to an export (init_grow): anchor_proj starts at zero, so the blocks equal the
    source's at step 0, and it gets gradients (the newest context feature is not zero); without init_grow the
    missing tensor is named. A fresh drafter with it starts at zero as well."""
    target = random_target(seed=8)
    src, _ = methods.build(_cfg(warm_start="none"), target, TARGET, None)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.05 * torch.randn_like(p)) if p.requires_grad else None
    grown, _ = methods.build(_cfg(warm_start="none", anchor_features=True, seed=3), target, TARGET, None)
    assert grown.anchor_proj.weight.abs().sum() == 0
    with torch.no_grad():
        grown.anchor_proj.weight.normal_()
    with pytest.raises(ValueError, match="anchor_proj.weight is missing"):
        methods.copy_trainable(src, grown, where="src")
    methods.copy_trainable(src, grown, where="src", grow=True)
    assert grown.anchor_proj.weight.abs().sum() == 0
    _same_blocks(src, grown, seed=3, anchors=[[0, 4, 8], [2, 6, -1]]).draft_logits.sum().backward()
    assert grown.anchor_proj.weight.grad.abs().sum() > 0
