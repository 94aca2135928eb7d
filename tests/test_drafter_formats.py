"""Published drafter checkpoint formats load and draft what the same weights draft in our format
(dspark/drafters/formats.py, dspark_checkpoint.py, eagle3*.py). Each checkpoint is written here by hand in
that format's layout (config keys, tensor names, Speculators' offset `d2t` + boolean `t2d`, stored
embedding / LM head), from a random drafter whose native checkpoint is the reference:

* DeepSpec EAGLE-3 (`Qwen3Eagle3Model`: target_layer_ids, ttt_length, embed_tokens + full lm_head);
* vLLM Speculators EAGLE-3 (transformer_layer_config, eagle_aux_hidden_state_layer_ids = tap + 1, reduced
  vocabulary), and its `norm_before_residual`;
* vLLM Speculators DSpark (sample_from_anchor: every slot predicts) and DFlash (the anchor predicts nothing);
* a stored embedding / LM head that differs from the target's is used (and logged), never replaced;
* names and shapes are checked from the safetensors headers without reading a tensor.

    pytest tests/test_drafter_formats.py -q
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import TINY_QWEN3
from dspark.config import SpecConfig
from dspark.drafters import build_drafter, check_drafter
from dspark.drafters.checkpoint import save_tensors
from dspark.drafters.dspark import save_dspark
from dspark.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model, bind_to_target, save_eagle3
from dspark.drafters.eagle3_model import state_dict_hf
from test_draft_topk import _propose
from test_dspark_drafter import TARGET, make_pool, random_model, tiny_cfg
from test_dspark_drafter import random_target as dspark_target
from test_eagle3_draft_model import CFG, _greedy_drafts, random_eagle3, random_target

BF16 = torch.bfloat16


def _build(path, method, target_cfg, target, n: int = 3, **kw):
    spec = SpecConfig(method=method, model=str(path), num_speculative_tokens=n, **kw)
    check_drafter(spec, target_cfg)
    return build_drafter(spec, target_config=target_cfg, target_model=target, dtype=torch.float32, device="cpu")


def _layer_config(cfg, model_type: str) -> dict:
    return {"model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu"}


def _offsets(d2t: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculators' vocabulary maps: d2t offsets (target = draft + offset) and the t2d mask."""
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[d2t] = True
    return d2t - torch.arange(d2t.numel()), t2d


# -- EAGLE-3 -----------------------------------------------------------------------------------------

def test_deepspec_eagle3_checkpoint_loads_and_drafts_the_reference(tmp_path):
    target = random_target(cfg=TINY_QWEN3)
    ref = random_eagle3(target)  # taps (-1, 0, 1), qk-norm layer
    c = ref.config
    config = {"architectures": ["Qwen3Eagle3Model"], "model_type": "qwen3", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
              "rms_norm_eps": c.rms_norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
              "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
              "tie_word_embeddings": False, "target_layer_ids": list(c.tap_layer_ids),
              "num_target_layers": TINY_QWEN3.num_hidden_layers, "ttt_length": 7, "step_loss_decay": 0.8,
              "draft_num_hidden_layers": 1, "target_model_name_or_path": "Qwen/Qwen3-tiny", "num_hidden_layers": 1}
    tensors = {**state_dict_hf(ref), "embed_tokens.weight": target.model.embed_tokens.weight.detach(),
               "lm_head.weight": target.lm_head.weight.detach()}
    save_tensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = _build(tmp_path, "eagle3", TINY_QWEN3, target)
    assert loaded.model.config.num_draft_tokens == 7 and loaded.model.config.qk_norm
    taps = torch.randn(5, 3 * 64)
    assert torch.equal(_greedy_drafts(loaded, taps), _greedy_drafts(Eagle3Drafter(ref, num_draft_tokens=3), taps))


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_speculators_eagle3_checkpoint_reduced_vocab_loads_and_drafts_the_reference(tmp_path, norm_before_residual):
    target = random_target()
    full = random_eagle3(target)
    d2t = torch.tensor(sorted(torch.randperm(256, generator=torch.Generator().manual_seed(3))[:40].tolist()))
    cfg = Eagle3Config.from_dict({**full.config.to_dict(), "draft_vocab_size": 40,
                                  "norm_before_residual": norm_before_residual})
    ref = Eagle3Model(cfg)
    ref.load_state_dict({k: v for k, v in full.state_dict().items() if k != "d2t"}, strict=False)
    ref.d2t = d2t
    ref = bind_to_target(ref, target).eval()
    offsets, t2d = _offsets(d2t, 256)
    tensors = {k: v for k, v in state_dict_hf(ref).items() if k != "d2t"}
    tensors.update({"d2t": offsets, "t2d": t2d, "embed_tokens.weight": target.model.embed_tokens.weight.detach(),
                    "lm_head.weight": target.lm_head.weight.detach()[d2t],
                    "verifier_norm.weight": torch.ones(64)})
    save_tensors(tensors, tmp_path / "model.safetensors", dtype=BF16)
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": _layer_config(CFG, "llama"), "draft_vocab_size": 40,
              "norm_before_residual": norm_before_residual, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": [t + 1 for t in cfg.tap_layer_ids],
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = _build(tmp_path, "eagle3", CFG, target)
    assert torch.equal(loaded.model.d2t, d2t) and loaded.model.config.tap_layer_ids == cfg.tap_layer_ids
    # the reference: the same weights rounded to bf16 as the file holds them
    save_eagle3(ref, cfg, str(tmp_path / "native"), dtype=BF16)
    native = _build(tmp_path / "native", "eagle3", CFG, target)
    taps = torch.randn(5, 3 * 64)
    drafts = _greedy_drafts(loaded, taps)
    assert torch.equal(drafts, _greedy_drafts(native, taps)) and set(drafts.flatten().tolist()) <= set(d2t.tolist())
    if norm_before_residual:  # the attention residual is hidden_norm(h), not h
        layer, h, a = ref.layers[0], torch.randn(2, 64), torch.randn(2, 64)
        mid = layer.hidden_norm(h) + a
        torch.testing.assert_close(layer.finish(h, a), mid + layer.mlp(layer.post_attention_layernorm(mid)))


def test_eagle3_own_embedding_differing_from_the_target_is_used(tmp_path, caplog):
    target = random_target()
    ref = random_eagle3(target)
    own = torch.randn(256, 64)
    save_tensors({**state_dict_hf(ref), "embed_tokens.weight": own}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(ref.config.to_dict()))
    with caplog.at_level(logging.WARNING):
        loaded = _build(tmp_path, "eagle3", CFG, target)
    assert "embed_tokens.weight differs from the target's" in caplog.text
    ids = torch.tensor([3, 9, 200])
    torch.testing.assert_close(loaded.model.embed(ids), own[ids])


def test_eagle3_header_mismatch_fails_without_reading_tensors(tmp_path, monkeypatch):
    target = random_target()
    ref = random_eagle3(target)
    save_tensors({**state_dict_hf(ref), "lm_head.weight": torch.zeros(255, 64)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(ref.config.to_dict()))
    import safetensors
    monkeypatch.setattr(safetensors.safe_open, "get_tensor", None, raising=False)  # no tensor data may be read
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \[255, 64\], the model expects \[256, 64\]"):
        check_drafter(SpecConfig(method="eagle3", model=str(tmp_path), num_speculative_tokens=3), CFG)


# -- DSpark / DFlash ---------------------------------------------------------------------------------

def _speculators_block_checkpoint(path, model, cfg, *, kind: str, target) -> None:
    tensors = {k: v for k, v in model.state_dict().items() if k not in ("d2t",)}
    tensors["embed_tokens.weight"] = target.model.embed_tokens.weight.detach()
    offsets, t2d = _offsets(model.d2t, cfg.vocab_size)
    tensors.update({"d2t": offsets, "t2d": t2d, "verifier_norm.weight": torch.ones(cfg.hidden_size)})
    save_tensors(tensors, path / "model.safetensors")
    layer = {**_layer_config(TARGET, "qwen3"), "num_hidden_layers": cfg.num_hidden_layers}
    config = {"speculators_model_type": kind, "architectures": [f"{kind.title()}Speculator"],
              "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
              "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
              "aux_hidden_state_layer_ids": [t + 1 for t in cfg.tap_layer_ids],
              "sample_from_anchor": cfg.slot_layout == "dspark", "num_anchors": 256}
    if kind == "dspark":
        config.update(markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                      enable_confidence_head=cfg.enable_confidence_head, confidence_head_with_markov=True)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind,layout,head", [("dspark", "dspark", "vanilla"), ("dspark", "dspark", "rnn"),
                                              ("dflash", "zlab", None)])
def test_speculators_block_drafter_loads_and_drafts_the_reference(tmp_path, kind, layout, head):
    cfg = tiny_cfg(slot_layout=layout, markov_rank=8 if head else 0, markov_head_type=head or "vanilla",
                   enable_confidence_head=head is not None, draft_vocab_size=48)
    model = random_model(cfg, seed=4)
    model.reset_buffers(d2t=torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(4))[:48].sort().values)
    target = dspark_target()
    _speculators_block_checkpoint(tmp_path, model, cfg, kind=kind, target=target)
    save_dspark(model, cfg, tmp_path / "native", dtype="float32")
    got = _build(tmp_path, kind, TARGET, target, n=cfg.max_draft_tokens)
    ref = _build(tmp_path / "native", kind, TARGET, target, n=cfg.max_draft_tokens)
    assert got.cfg == ref.cfg and torch.equal(got.model.d2t, model.d2t)
    for d in (got, ref):
        make_pool(d, num_blocks=16, kv_block_size=4)
    a, b = _propose(got, "greedy"), _propose(ref, "greedy")
    assert torch.equal(a.draft_ids, b.draft_ids)
    if head:
        torch.testing.assert_close(a.confidence, b.confidence)


def test_dspark_own_embedding_and_head_differing_from_the_target_are_used(tmp_path, caplog):
    cfg = tiny_cfg(enable_confidence_head=True)
    model = random_model(cfg, seed=5)  # its random embedding and head are not the target's
    save_dspark(model, cfg, tmp_path, dtype="float32", include_shared=True)
    target = dspark_target()
    with caplog.at_level(logging.WARNING):
        got = _build(tmp_path, "dspark", TARGET, target)
    assert "embed_tokens.weight differs" in caplog.text and "lm_head.weight differs" in caplog.text
    assert torch.equal(got.model.embed_tokens.weight, model.embed_tokens.weight)
    assert torch.equal(got.model.lm_head.weight, model.lm_head.weight)
    assert got.model.embed_tokens.weight.data_ptr() != target.model.embed_tokens.weight.data_ptr()


def test_dspark_header_mismatch_fails_without_reading_tensors(tmp_path, monkeypatch):
    cfg = tiny_cfg()
    model = random_model(cfg)
    save_dspark(model, cfg, tmp_path, dtype="float32")
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["layers.1.mlp.up_proj.weight"] = torch.zeros(47, 32)
    save_tensors(tensors, tmp_path / "model.safetensors")
    import dspark.drafters.dspark_checkpoint as ckpt
    monkeypatch.setattr(ckpt, "load_tensors", None)  # the check must not read tensors
    with pytest.raises(ValueError, match=r"'layers.1.mlp.up_proj.weight' has shape \[47, 32\]"):
        check_drafter(SpecConfig(method="dspark", model=str(tmp_path), num_speculative_tokens=3), TARGET)
    with pytest.raises(ValueError, match="is an EAGLE-3 checkpoint"):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3Eagle3Model"], "ttt_length": 7}))
        check_drafter(SpecConfig(method="dspark", model=str(tmp_path), num_speculative_tokens=3), TARGET)


# -- target folder ------------------------------------------------------------------------------------

def test_target_folder_without_tokenizer_is_refused_before_weights_load(tmp_path, monkeypatch):
    from tiny_checkpoint import write_tiny_checkpoint

    from dspark.config import EngineConfig
    from dspark.engine import build as build_mod
    from dspark.models import loader

    folder = write_tiny_checkpoint(tmp_path / "tiny")
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    monkeypatch.setattr(build_mod, "check_drafter", None)  # must not be reached either
    monkeypatch.setattr(loader, "build_model", None)
    with pytest.raises(ValueError, match="no tokenizer"):
        build_mod.build_engine(EngineConfig(model=str(folder)))
    with pytest.raises(ValueError, match="no tokenizer"):
        loader.load_model(folder)
