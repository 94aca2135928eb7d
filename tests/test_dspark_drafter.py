"""Tests for the DSpark / DFlash drafter (dspark/drafters/dspark*.py, heads.py, checkpoint.py):

* paged, incremental inference (context extended in chunks, a verify-style partial commit, two requests
  of different lengths) gives the same block logits as one dense `training_forward` (fp32, atol 1e-4);
* each sequential head's step loop reproduces its teacher-forced `block_logits`;
* a hand-written DeepSpec-format checkpoint (reference key names, scaled down) loads and drafts; wrong keys
  / shapes and every bad config combination are rejected with the offending name;
* save → load round trip (full and reduced draft vocab);

Reduced-precision products and end-to-end greedy parity: tests/test_dspark_drafter_dtypes.py.

    pytest tests/test_dspark_drafter.py -q
"""

from __future__ import annotations

import json
import random

import pytest
import torch


from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch
from dspark.drafters.checkpoint import save_tensors
from dspark.drafters.dspark import DSparkDrafter, build, check, load_dspark, save_dspark
from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.heads import SEQUENTIAL_HEADS
from dspark.sampling import SamplingParams
from tests.dspark_helpers import (ATOL, TAPS, TARGET, make_pool, propose_request, random_model, random_target,
                                  spec, tiny_cfg)


def test_config_from_released_deepspec_and_zlab_json():
    qwen3_4b = {  # reference §3.2, with the HF keys a loader must ignore
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "dtype": "bfloat16",
        "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 5,
        "num_target_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000},
        "max_position_embeddings": 40960, "layer_types": ["full_attention"] * 5, "sliding_window": None,
        "tie_word_embeddings": False, "block_size": 7, "mask_token_id": 151669,
        "target_layer_ids": [1, 9, 17, 25, 33], "num_anchors": 512, "markov_rank": 256,
        "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}
    cfg = DSparkConfig.from_deepspec_json(qwen3_4b)
    assert (cfg.tap_layer_ids, cfg.rope_theta, cfg.max_draft_tokens) == ((1, 9, 17, 25, 33), 1e6, 7)
    assert cfg.slot_layout == "dspark" and cfg.markov_rank == 256 and cfg.enable_confidence_head
    assert DSparkConfig.from_deepspec_json(cfg.to_json()) == cfg
    zlab = {k: v for k, v in qwen3_4b.items() if k not in ("mask_token_id", "target_layer_ids")}
    zlab.update(block_size=16, markov_rank=0, enable_confidence_head=False,
                dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]})
    zcfg = DSparkConfig.from_deepspec_json(zlab)
    assert zcfg.slot_layout == "zlab" and zcfg.max_draft_tokens == 15 and zcfg.mask_token_id == 151669


# -- paged / incremental == dense

@pytest.mark.parametrize("layout,head,anchor,fused", [("dspark", "vanilla", False, True), ("dspark", "rnn", False, True),
                                                      ("zlab", None, False, True), ("dspark", "vanilla", True, True),
                                                      ("dspark", "vanilla", True, False)])
def test_paged_incremental_equals_dense(layout, head, anchor, fused, monkeypatch):
    """anchor: anchor_features (the newest context feature into each block's rows, read from the pool);
    fused False: the module path (kernels off)."""
    from dspark import kernels
    if not fused:
        monkeypatch.setattr(kernels, "enabled", lambda: False)
    cfg = tiny_cfg(slot_layout=layout, markov_rank=0 if head is None else 8,
                   markov_head_type=head or "vanilla", anchor_features=anchor)
    model = random_model(cfg)
    assert (model.anchor_proj is not None) == anchor
    gamma = cfg.max_draft_tokens
    drafter = DSparkDrafter(model, num_draft_tokens=gamma)
    kv_block_size = 4
    make_pool(drafter, num_blocks=24, kv_block_size=kv_block_size)
    blocks = list(range(1, 24))
    random.Random(0).shuffle(blocks)
    tables = [blocks[:10], blocks[10:20]]  # disjoint, non-contiguous; block 0 only as gather padding
    g = torch.Generator().manual_seed(0)
    seq_len = [23, 11]
    taps = [torch.randn(n, cfg.num_taps * cfg.hidden_size, generator=g) for n in seq_len]
    ids = [torch.randint(3, 120, (n,), generator=g).tolist() for n in seq_len]

    def extend(chunks):  # chunks: (request index, start, count), all in one flat "batch" with junk rows
        rows, segments, offset = [torch.randn(3, taps[0].shape[1], generator=g)], [], 3
        for r, start, count in chunks:
            rows.append(taps[r][start:start + count])
            segments.append(ContextSegment(request_id=f"r{r}", block_table=tables[r], start_pos=start,
                                           token_ids=ids[r][start:start + count], next_token_id=None,
                                           tap_rows=slice(offset, offset + count)))
            offset += count
        done = drafter.extend_context(ContextUpdate(segments=segments, taps=torch.cat(rows)))
        for r, start, count in chunks:
            assert done[f"r{r}"] == start + count

    # request 0: prefill chunks 0..9 and 10..15, then a verify window [x, d1, d2, d3] at 16 with two
    # accepted (commits 16..18), then one more window committing 19..21; anchor = 22.
    extend([(0, 0, 10), (1, 0, 6)])
    extend([(0, 10, 6), (1, 6, 4)])
    extend([(0, 16, 3)])
    extend([(0, 19, 3)])
    anchors = [22, 10]
    batch = ProposeBatch(requests=[propose_request(f"r{r}", ids[r], anchors[r], tables[r]) for r in (0, 1)],
                         kv_block_size=kv_block_size, draft_sample_method="greedy")
    base, hidden, _ = drafter.forward_blocks(batch)
    assert base.shape == (2, gamma, cfg.vocab_size)
    for r in (0, 1):
        with torch.no_grad():
            dense = model.training_forward(taps=taps[r][None], input_ids=torch.tensor([ids[r]]),
                                           anchor_positions=torch.tensor([[anchors[r], -1]]))
        err = (dense.base_logits[0, 0] - base[r]).abs().max().item()
        assert err < ATOL, f"request {r}: paged block logits differ from dense by {err:.2e} (atol {ATOL})"
        assert (dense.labels[0, 1] == -100).all(), "an invalid anchor must not be supervised"
    proposal = drafter.propose(batch)
    assert proposal.draft_ids.shape == (2, gamma) and proposal.draft_probs is None
    # greedy drafts are a fixed point of the teacher-forced head: argmax(head(base | own drafts)) == drafts
    prev = torch.cat([torch.tensor([[ids[0][22]], [ids[1][10]]]), proposal.draft_ids[:, :-1]], dim=1)
    with torch.no_grad():
        corrected = model.head_logits(base, hidden=hidden, prev_ids=prev)
    assert torch.equal(corrected.argmax(-1), proposal.draft_ids)


def test_training_forward_shapes_labels_and_mask():
    cfg = tiny_cfg(enable_confidence_head=True)
    model = random_model(cfg)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 120, (2, 12), generator=g)
    taps = torch.randn(2, 12, cfg.num_taps * cfg.hidden_size, generator=g)
    anchors = torch.tensor([[0, 5, 10], [3, -1, 9]])
    out = model.training_forward(taps=taps, input_ids=ids, anchor_positions=anchors)
    assert out.draft_logits.shape == out.base_logits.shape == (2, 3, 4, cfg.vocab_size)
    assert out.confidence_logits.shape == (2, 3, 4) and out.target_label_ids.shape == (2, 3, 4)
    assert out.labels.tolist()[0][1] == ids[0, 6:10].tolist()
    assert out.labels.tolist()[0][2] == [ids[0, 11].item(), -100, -100, -100]  # past the end
    assert out.labels.tolist()[1][1] == [-100] * 4
    # a block never sees other blocks or context at/after its anchor: changing those changes nothing
    taps2, ids2 = taps.clone(), ids.clone()
    taps2[0, 5:] += 1.0
    ids2[0, 6:] = 7  # tokens after anchor 5 (anchor token itself kept)
    out2 = model.training_forward(taps=taps2, input_ids=ids2, anchor_positions=anchors)
    assert torch.allclose(out.base_logits[0, 1], out2.base_logits[0, 1], atol=1e-5)
    assert torch.allclose(out.base_logits[0, 0], out2.base_logits[0, 0], atol=1e-5)
    out.draft_logits.sum().backward()  # trainable end to end
    assert model.fc.weight.grad is not None and model.embed_tokens.weight.grad is None


# -- sequential heads

@pytest.mark.parametrize("head_type", list(SEQUENTIAL_HEADS))
def test_head_step_loop_equals_teacher_forced(head_type):
    cfg = tiny_cfg(markov_head_type=head_type, enable_confidence_head=True)
    model = random_model(cfg)
    g = torch.Generator().manual_seed(5)
    num_rows, gamma = 3, cfg.block_size
    base = torch.randn(num_rows, gamma, cfg.vocab_size, generator=g)
    hidden = torch.randn(num_rows, gamma, cfg.hidden_size, generator=g)
    prev = torch.randint(0, cfg.vocab_size, (num_rows, gamma), generator=g)  # [anchor, x_1 .. x_{γ-1}]
    head = model.markov_head
    with torch.no_grad():
        batched = head.block_logits(base_logits=base, hidden=hidden, prev_ids=prev)
        state = head.init_state(num_rows=num_rows, device="cpu", dtype=torch.float32)
        for k in range(gamma):
            step, state = head.step(base_logits=base[:, k], hidden=hidden[:, k], prev_ids=prev[:, k],
                                    state=state)
            err = (step - batched[:, k]).abs().max().item()
            assert err < 1e-5, f"{head_type} step {k} differs from block_logits by {err:.2e}"
        conf = model.confidence_logits(hidden, prev_ids=prev)
        assert conf.shape == (num_rows, gamma) and conf.dtype == torch.float32


def test_probabilistic_drafts_and_confidence_temperatures():
    cfg = tiny_cfg(enable_confidence_head=True, draft_vocab_size=64)
    model = random_model(cfg)
    model.reset_buffers(d2t=torch.randperm(cfg.vocab_size)[:64])
    drafter = DSparkDrafter(model, num_draft_tokens=3, confidence_temperatures=[2.0, 0.5])
    make_pool(drafter, num_blocks=8, kv_block_size=4)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 120, (9,), generator=g).tolist()
    table = [3, 5, 1]
    taps = torch.randn(8, cfg.num_taps * cfg.hidden_size, generator=g)
    drafter.extend_context(ContextUpdate([ContextSegment("a", table, 0, ids[:8], None, slice(0, 8))], taps))
    reqs = [propose_request("a", ids, 8, table, SamplingParams(temperature=0.8, top_k=5),
                            torch.Generator().manual_seed(0)),
            propose_request("b", ids, 8, table)]  # greedy row inside a probabilistic batch
    batch = ProposeBatch(requests=reqs, kv_block_size=4, draft_sample_method="probabilistic")
    proposal = drafter.propose(batch)
    probs = proposal.draft_probs
    assert probs.shape == (2, 3, cfg.vocab_size)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3), atol=1e-5)
    outside = torch.ones(cfg.vocab_size, dtype=torch.bool)
    outside[model.d2t] = False
    assert probs[..., outside].abs().max() == 0, "mass outside the draft vocabulary"
    assert ((probs[0] > 0).sum(-1) <= 5).all(), "top_k=5 not applied"
    assert all(probs[i, k, proposal.draft_ids[i, k]] > 0 for i in range(2) for k in range(3))
    assert torch.equal(probs[1].argmax(-1), proposal.draft_ids[1]) and (probs[1].max(-1).values == 1).all()
    # confidence = σ(z_k / T_k) with the sampled predecessor
    base, hidden, anchor = drafter.forward_blocks(batch)
    prev = torch.cat([anchor[:, None], proposal.draft_ids[:, :-1]], dim=1)
    z = model.confidence_logits(hidden, prev_ids=prev)
    expected = torch.sigmoid(z / torch.tensor([2.0, 0.5, 1.0]))
    assert torch.allclose(proposal.confidence, expected, atol=1e-6)
    # a separate greedy fit divides the greedy row's logits; the sampling row keeps its own
    drafter.greedy_confidence_temperatures = torch.tensor([0.25, 4.0, 1.0])
    reqs = [propose_request("a", ids, 8, table, SamplingParams(temperature=0.8, top_k=5),
                            torch.Generator().manual_seed(0)), propose_request("b", ids, 8, table)]
    again = drafter.propose(ProposeBatch(requests=reqs, kv_block_size=4, draft_sample_method="probabilistic"))
    assert torch.equal(again.draft_ids, proposal.draft_ids)
    torch.testing.assert_close(again.confidence[0], expected[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(again.confidence[1], torch.sigmoid(z[1] / torch.tensor([0.25, 4.0, 1.0])),
                               atol=1e-6, rtol=1e-5)


# -- checkpoints

def write_deepspec_checkpoint(path, *, target=TARGET, taps=TAPS, rank=8, confidence=True, block=4,
                              tensors_edit=None, config_edit=None, with_shared=True):
    """A DeepSpec-format folder written by hand from the reference names and shapes (§3.2, §3.3)."""
    d, hd, heads, kv, inter, vocab = (target.hidden_size, target.head_dim, target.num_attention_heads,
                                      target.num_key_value_heads, target.intermediate_size, target.vocab_size)
    g = torch.Generator().manual_seed(11)
    shapes = {"fc.weight": [d, len(taps) * d], "hidden_norm.weight": [d], "norm.weight": [d]}
    if with_shared:
        shapes.update({"embed_tokens.weight": [vocab, d], "lm_head.weight": [vocab, d]})
    for i in range(2):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": [d], p + "post_attention_layernorm.weight": [d],
                       p + "self_attn.q_proj.weight": [heads * hd, d], p + "self_attn.k_proj.weight": [kv * hd, d],
                       p + "self_attn.v_proj.weight": [kv * hd, d], p + "self_attn.o_proj.weight": [d, heads * hd],
                       p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd],
                       p + "mlp.gate_proj.weight": [inter, d], p + "mlp.up_proj.weight": [inter, d],
                       p + "mlp.down_proj.weight": [d, inter]})
    if rank:
        shapes.update({"markov_head.markov_w1.weight": [vocab, rank], "markov_head.markov_w2.weight": [vocab, rank]})
    if confidence:
        shapes.update({"confidence_head.proj.weight": [1, d + rank], "confidence_head.proj.bias": [1]})
    tensors = {k: (0.2 * torch.randn(*s, generator=g)).to(torch.bfloat16) for k, s in shapes.items()}
    (tensors_edit or (lambda t: None))(tensors)
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(tensors, path / "model.safetensors")
    config = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "dtype": "bfloat16",
        "vocab_size": vocab, "hidden_size": d, "intermediate_size": inter, "num_hidden_layers": 2,
        "num_target_layers": target.num_hidden_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "attention_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 256, "layer_types": ["full_attention"] * 2, "sliding_window": None,
        "tie_word_embeddings": False, "block_size": block, "mask_token_id": 127,
        "target_layer_ids": list(taps), "num_anchors": 512, "markov_rank": rank,
        "enable_confidence_head": confidence}
    if rank:
        config["markov_head_type"] = "vanilla"
    if confidence:
        config["confidence_head_with_markov"] = True
    (config_edit or (lambda c: None))(config)
    (path / "config.json").write_text(json.dumps(config))
    return path




def test_deepspec_checkpoint_loads_aliases_and_drafts(tmp_path):
    target = random_target()
    # DeepSpec stores bf16 copies of the target's embedding and head: they are the target's, so aliased
    ckpt = write_deepspec_checkpoint(tmp_path / "ds", tensors_edit=lambda t: t.update({
        "embed_tokens.weight": target.model.embed_tokens.weight.detach().to(torch.bfloat16),
        "lm_head.weight": target.lm_head.weight.detach().to(torch.bfloat16)}))
    drafter = build(spec(ckpt, length_policy="prefix"), target_config=TARGET, target_model=target,
                    dtype=torch.float32, device="cpu")
    assert drafter.has_confidence and drafter.tap_layer_ids == TAPS
    model = drafter.model
    assert model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    make_pool(drafter, num_blocks=8, kv_block_size=4)
    taps = torch.randn(6, len(TAPS) * TARGET.hidden_size)
    drafter.extend_context(ContextUpdate([ContextSegment("a", [2, 4], 0, [5] * 6, None, slice(0, 6))], taps))
    proposal = drafter.propose(ProposeBatch([propose_request("a", [5] * 7, 6, [2, 4, 6])], 4, "greedy"))
    assert proposal.draft_ids.shape == (1, 4) and proposal.confidence.shape == (1, 4)
    assert ((proposal.confidence > 0) & (proposal.confidence < 1)).all()
    dflash = build(spec(ckpt, method="dflash"), target_config=TARGET, target_model=target,
                   dtype=torch.float32, device="cpu")  # dflash on a DSpark checkpoint: heads off
    assert dflash.model.markov_head is None and not dflash.has_confidence


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({"fc.bias": torch.zeros(32)}), "'fc.bias'"),
    (lambda t: t.pop("layers.1.mlp.up_proj.weight"), r"'layers.1.mlp.up_proj.weight' \(expected shape \[48, 32\]"),
    (lambda t: t.update({"markov_head.markov_w1.weight": torch.zeros(128, 4)}),
     r"'markov_head.markov_w1.weight' has shape \[128, 4\], the model expects \[128, 8\]"),
])
def test_checkpoint_wrong_key_or_shape_is_named(tmp_path, edit, message):
    ckpt = write_deepspec_checkpoint(tmp_path / "bad", tensors_edit=edit)
    with pytest.raises(ValueError, match=message):
        build(spec(ckpt), target_config=TARGET, target_model=random_target(), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("config_edit,spec_kw,message", [
    (lambda c: c.update(vocab_size=100, mask_token_id=5), {}, "vocab_size 100 != target vocab_size 128"),
    (lambda c: c.update(hidden_size=48), {}, "hidden_size 48 != target hidden_size 32"),
    (lambda c: c.update(target_layer_ids=[0, 3]), {}, "tap layer id 3"),  # the final target layer
    (lambda c: c.update(target_layer_ids=[-2, 1]), {}, "tap layer id -2"),
    (lambda c: c.update(target_layer_ids=[0, 5], num_target_layers=8), {}, "tap layer id 5"),
    (lambda c: None, {"n": 5}, "num_speculative_tokens 5 > the drafter's 4"),
    (lambda c: c.update(enable_confidence_head=False), {"length_policy": "threshold"}, "needs a confidence head"),
    (lambda c: None, {"method": "dflash", "length_policy": "prefix"}, "needs a confidence head"),
    (lambda c: c.update(markov_rank=0), {}, "markov_rank 0"),
    (lambda c: c.pop("mask_token_id"), {}, "'mask_token_id'"),
])
def test_check_rejects_bad_configs_before_weights(tmp_path, config_edit, spec_kw, message):
    ckpt = write_deepspec_checkpoint(tmp_path / "c", config_edit=config_edit)
    (ckpt / "model.safetensors").unlink()  # check must fail on config.json alone
    with pytest.raises(ValueError, match=message):
        check(spec(ckpt, **spec_kw), TARGET)


@pytest.mark.parametrize("draft_vocab_size", [None, 48])
def test_save_load_round_trip(tmp_path, draft_vocab_size):
    cfg = tiny_cfg(enable_confidence_head=True, draft_vocab_size=draft_vocab_size, markov_head_type="gated",
                   anchor_features=draft_vocab_size is not None)
    target = random_target()
    model = random_model(cfg)
    if draft_vocab_size:
        model.reset_buffers(d2t=torch.randperm(cfg.vocab_size)[:draft_vocab_size])
    model.share_target_weights(embed_weight=target.model.embed_tokens.weight,
                               lm_head_weight=target.lm_head.weight)
    save_dspark(model, cfg, tmp_path / "ours", dtype="float32")
    (tmp_path / "ours" / "calibration.json").write_text(json.dumps({"temperatures": [1.5] * 4}))
    loaded, temps = load_dspark(tmp_path / "ours", target_model=target)
    assert temps == {"temperatures": [1.5] * 4} and loaded.cfg == cfg
    assert torch.equal(loaded.d2t, model.d2t)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 120, (1, 10), generator=g)
    taps = torch.randn(1, 10, cfg.num_taps * cfg.hidden_size, generator=g)
    anchors = torch.tensor([[2, 6]])
    with torch.no_grad():
        a = model.training_forward(taps=taps, input_ids=ids, anchor_positions=anchors)
        b = loaded.training_forward(taps=taps, input_ids=ids, anchor_positions=anchors)
    assert torch.equal(a.draft_logits, b.draft_logits) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.confidence_logits, b.confidence_logits)
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert DSparkConfig.from_deepspec_json(saved) == cfg
    assert (loaded.anchor_proj is not None) == cfg.anchor_features == saved["anchor_features"]
