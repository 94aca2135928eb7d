"""How checkpoints store the draft vocabulary map `d2t` (dspark/drafters/vocab.py): written as offsets (target id =
draft id + d2t[draft id], the convention of EAGLE-3's reference code, Speculators, vLLM, SGLang and llama.cpp) with
`"d2t_format": "offset"` in config.json, read in either convention.

* every branch of the reading rule: an explicit `d2t_format` (offset, absolute; unknown or contradicted: refused),
  only one reading valid, both valid (ours → absolute ids, the ecosystem's formats → offsets, logged), neither;
* what `save_dspark`, `save_eagle3` and `dspark train`'s export write, and that it loads back to the same drafts;
* a legacy checkpoint of absolute ids (no `d2t_format`) still loads, DSpark and EAGLE-3;
* a hand-written Speculators EAGLE-3 checkpoint whose offsets also read as valid absolute ids loads as offsets;
* an invalid d2t (out of range either way, repeated target ids) is refused naming d2t before any weight is read.

    pytest tests/test_d2t_format.py -q
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.config import SpecConfig
from dspark.drafters import build_drafter, check_drafter
from dspark.drafters.dspark import DSparkDrafter, load_dspark, save_dspark
from dspark.drafters.eagle3 import Eagle3Config, Eagle3Model, bind_to_target, save_eagle3
from dspark.drafters.eagle3_model import load_eagle3, state_dict_hf
from dspark.drafters.vocab import decode_d2t, read_d2t, to_offsets
from test_draft_topk import _propose
from test_drafter_formats import _build, _layer_config, _offsets
from test_dspark_drafter import TARGET, make_pool, random_model, random_target, tiny_cfg
from test_eagle3_draft_model import CFG, _greedy_drafts
from test_eagle3_draft_model import random_eagle3, random_target as eagle3_target

NATIVE = {"format": "dspark-eagle3"}  # any config without the Speculators key or DeepSpec's EAGLE-3 marks
SPECULATORS = {"speculators_model_type": "eagle3"}
DEEPSPEC_EAGLE3 = {"architectures": ["Qwen3Eagle3Model"]}


def _decode(stored, config, vocab=16):
    return decode_d2t(torch.tensor(stored), vocab_size=vocab, config=config, where="ckpt")


# -- the reading rule --------------------------------------------------------------------------------

def test_an_explicit_d2t_format_wins():
    both = [0, 2, 4, 6]  # valid as absolute ids and as offsets (→ 0, 3, 6, 9)
    assert _decode(both, {**SPECULATORS, "d2t_format": "absolute"}).tolist() == [0, 2, 4, 6]
    assert _decode(both, {**NATIVE, "d2t_format": "offset"}).tolist() == [0, 3, 6, 9]
    with pytest.raises(ValueError, match="d2t_format 'relative' unknown"):
        _decode(both, {"d2t_format": "relative"})
    with pytest.raises(ValueError, match=r"d2t \(d2t_format 'offset'\) must hold distinct target ids in \[0, 16\)"):
        _decode([3, 2, 1, 0], {"d2t_format": "offset"})  # every id 3: valid only as absolute ids
    with pytest.raises(ValueError, match=r"d2t \(d2t_format 'absolute'\).*span \[10, 19\]"):
        _decode([10, 12, 19], {"d2t_format": "absolute"})


def test_without_d2t_format_the_one_valid_reading_is_taken():
    # offsets of an ascending table: as absolute ids they repeat (the zeros), as offsets they are distinct
    assert _decode([0, 0, 1, 1, 5], NATIVE).tolist() == [0, 1, 3, 4, 9]
    # absolute ids reaching the vocabulary's top: as offsets they run past it (15 + 3)
    assert _decode([1, 2, 9, 15], SPECULATORS).tolist() == [1, 2, 9, 15]
    # the identity offsets (all zero) against non-distinct absolute ids
    assert _decode([0, 0, 0], DEEPSPEC_EAGLE3).tolist() == [0, 1, 2]


def test_both_readings_valid_ours_are_absolute_the_ecosystems_offsets(caplog):
    stored = [1, 3, 4, 8]  # absolute: 1 3 4 8; offsets: 1 4 6 11 — both distinct and inside 16
    with caplog.at_level(logging.INFO, logger="dspark.drafters.vocab"):
        assert _decode(stored, NATIVE).tolist() == [1, 3, 4, 8]
        assert "read as absolute" in caplog.text
        caplog.clear()
        for config in (SPECULATORS, DEEPSPEC_EAGLE3, {"speculators_model_type": "dspark"}):
            assert _decode(stored, config).tolist() == [1, 4, 6, 11]
            assert "read as offset" in caplog.text


@pytest.mark.parametrize("stored", [[16, 17, 18],  # out of range either way
                                    [-1, -1, 5],  # negative either way
                                    [0, -1, 0, 0]])  # repeated ids either way
def test_neither_reading_valid_is_refused(stored):
    with pytest.raises(ValueError, match=r"ckpt: d2t must hold distinct target ids in \[0, 16\) either as"):
        _decode(stored, NATIVE)


# -- DSpark / DFlash ---------------------------------------------------------------------------------

D2T = torch.tensor([1, 2, 5, 9, 17, 33, 40, 41, 60, 77, 90, 100, 120, 126, 127])  # ascending, up to the top


def _saved_dspark(path, d2t=D2T):
    cfg = tiny_cfg(enable_confidence_head=True, draft_vocab_size=d2t.numel())
    target = random_target()
    model = random_model(cfg, seed=3)
    model.reset_buffers(d2t=d2t)
    model.share_target_weights(embed_weight=target.model.embed_tokens.weight, lm_head_weight=target.lm_head.weight)
    save_dspark(model, cfg, path, dtype="float32")
    return model, cfg, target


def test_save_dspark_writes_offsets_and_loads_the_same_drafts(tmp_path):
    model, cfg, target = _saved_dspark(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["d2t_format"] == "offset"
    stored = load_file(str(tmp_path / "model.safetensors"))["d2t"]
    assert torch.equal(stored, D2T - torch.arange(D2T.numel())) and stored.dtype == torch.int64
    loaded = _build(tmp_path, "dspark", TARGET, target, n=cfg.block_size, draft_matmul_dtype="float32")
    assert torch.equal(loaded.model.d2t, D2T)
    ref = DSparkDrafter(model, num_draft_tokens=cfg.block_size)
    make_pool(ref, num_blocks=16, kv_block_size=4)
    make_pool(loaded, num_blocks=16, kv_block_size=4)
    for method in ("greedy", "probabilistic"):
        a, b = _propose(ref, method), _propose(loaded, method)
        assert torch.equal(a.draft_ids, b.draft_ids), method
        assert set(a.draft_ids.flatten().tolist()) <= set(D2T.tolist())
    torch.testing.assert_close(a.draft_probs, b.draft_probs)
    full = tiny_cfg()  # a full-vocabulary checkpoint stores no d2t and says nothing of one
    save_dspark(random_model(full), full, tmp_path / "full", dtype="float32")
    assert "d2t_format" not in json.loads((tmp_path / "full" / "config.json").read_text())


def test_legacy_absolute_dspark_checkpoint_still_loads(tmp_path):
    """A checkpoint written before d2t was stored as offsets: absolute ids, no d2t_format."""
    model, cfg, target = _saved_dspark(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({**tensors, "d2t": D2T.clone()}, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["d2t_format"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded, _ = load_dspark(tmp_path, target_model=target)
    assert torch.equal(loaded.d2t, D2T)
    # ids valid both ways (they stop well below the top): ours were absolute, so they still read so
    low = torch.tensor([0, 3, 4, 10, 20, 21, 30, 31, 32, 50, 51, 52, 60, 61, 62])
    save_file({**tensors, "d2t": low}, str(tmp_path / "model.safetensors"))
    assert torch.equal(read_d2t(tmp_path, vocab_size=128, where="x"), low)


@pytest.mark.parametrize("stored,message", [
    (torch.arange(15) + 128, r"either as absolute ids \(they span \[128, 142\]\)"),  # out of range either way
    (torch.tensor([0, -1] + [0] * 13), "either as absolute ids"),  # repeated target ids either way
    (None, r"d2t \(d2t_format 'offset'\) must hold distinct target ids in \[0, 128\): 14 repeated"),
])
def test_invalid_d2t_is_refused_before_any_weight_is_read(tmp_path, monkeypatch, stored, message):
    _, cfg, target = _saved_dspark(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    if stored is None:  # offsets that give every draft id one target id
        stored = 5 - torch.arange(15)
    else:
        del config["d2t_format"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({**tensors, "d2t": stored}, str(tmp_path / "model.safetensors"))
    import dspark.drafters.dspark_checkpoint as ckpt
    monkeypatch.setattr(ckpt, "load_tensors", None)  # neither the check nor the load may read a weight first
    with pytest.raises(ValueError, match=message):
        check_drafter(SpecConfig(method="dspark", model=str(tmp_path), num_speculative_tokens=4), TARGET)
    with pytest.raises(ValueError, match=message):
        load_dspark(tmp_path, target_model=target)


def test_train_exports_store_offsets(tmp_path):
    from dspark.train import methods
    model, cfg, _ = _saved_dspark(tmp_path / "unused")
    methods.export_block_drafter(model, cfg, tmp_path / "dspark")
    target = eagle3_target()
    d2t = torch.tensor([0, 3, 8, 100, 255])
    ecfg = Eagle3Config.from_dict({**random_eagle3(target).config.to_dict(), "draft_vocab_size": 5})
    eagle = Eagle3Model(ecfg).init_weights(seed=2)
    eagle.d2t = d2t
    methods.export_eagle3(eagle, ecfg, tmp_path / "eagle3")
    for folder, ids in (("dspark", D2T), ("eagle3", d2t)):
        assert json.loads((tmp_path / folder / "config.json").read_text())["d2t_format"] == "offset"
        assert torch.equal(load_file(str(tmp_path / folder / "model.safetensors"))["d2t"], to_offsets(ids))
    assert torch.equal(load_eagle3(str(tmp_path / "eagle3")).d2t, d2t)


# -- EAGLE-3 -----------------------------------------------------------------------------------------

def _reduced_eagle3(target, d2t, **overrides):
    full = random_eagle3(target)
    cfg = Eagle3Config.from_dict({**full.config.to_dict(), "draft_vocab_size": d2t.numel(), **overrides})
    model = Eagle3Model(cfg)
    model.load_state_dict({k: v for k, v in full.state_dict().items() if k != "d2t"}, strict=False)
    model.d2t = d2t
    return bind_to_target(model, target).eval(), cfg


def test_legacy_absolute_eagle3_checkpoint_still_loads(tmp_path):
    target = eagle3_target()
    d2t = torch.tensor(sorted(set(torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(1)).tolist())
                              | {255}))
    model, cfg = _reduced_eagle3(target, d2t)
    save_eagle3(model, cfg, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["d2t_format"] == "offset"
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({**tensors, "d2t": d2t.clone()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))  # as written before: no d2t_format
    loaded = _build(tmp_path, "eagle3", CFG, target)
    assert torch.equal(loaded.model.d2t, d2t)
    from dspark.drafters.eagle3 import Eagle3Drafter
    taps = torch.randn(5, 3 * 64)
    assert torch.equal(_greedy_drafts(loaded, taps), _greedy_drafts(Eagle3Drafter(model, num_draft_tokens=3), taps))


def test_speculators_eagle3_offsets_that_also_read_as_absolute_ids_load_as_offsets(tmp_path):
    """Hand-written in the Speculators layout (offset d2t, boolean t2d, no d2t_format): the offsets are
    ascending and distinct, so they are valid absolute ids too; the ecosystem's convention decides."""
    target = eagle3_target()
    d2t = torch.tensor([0, 2, 5, 9, 14, 20, 27, 35, 44, 54, 65, 77, 90, 104, 119, 135])  # gaps grow: offsets distinct
    model, cfg = _reduced_eagle3(target, d2t)
    offsets, t2d = _offsets(d2t, 256)
    assert len(set(offsets.tolist())) == d2t.numel()
    tensors = {k: v for k, v in state_dict_hf(model).items() if k != "d2t"}
    tensors.update({"d2t": offsets, "t2d": t2d, "lm_head.weight": target.lm_head.weight.detach()[d2t]})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": _layer_config(CFG, "llama"), "draft_vocab_size": d2t.numel(),
              "eagle_aux_hidden_state_layer_ids": [t + 1 for t in cfg.tap_layer_ids],
              "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = _build(tmp_path, "eagle3", CFG, target)
    assert torch.equal(loaded.model.d2t, d2t)
    bad = t2d.clone()
    bad[d2t[3]], bad[d2t[3] + 1] = False, True  # t2d marks another id
    save_file({**{k: v.contiguous() for k, v in tensors.items()}, "t2d": bad}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        build_drafter(SpecConfig(method="eagle3", model=str(tmp_path), num_speculative_tokens=3),
                      target_config=CFG, target_model=target, dtype=torch.float32, device="cpu")
