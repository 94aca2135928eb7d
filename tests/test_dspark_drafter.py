"""Tests for the DSpark / DFlash drafter (dspark/drafters/dspark*.py, heads.py, checkpoint.py):

* paged, incremental inference (context extended in chunks, a verify-style partial commit, two requests
  of different lengths) gives the same block logits as one dense `training_forward` (fp32, atol 1e-4);
* each sequential head's step loop reproduces its teacher-forced `block_logits`;
* a hand-written DeepSpec-format checkpoint (reference key names, scaled down) loads and drafts; wrong keys
  / shapes and every bad config combination are rejected with the offending name;
* save → load round trip (full and reduced draft vocab);
* bf16 products ("draft_matmul_dtype"): the backbone's linears in bf16, heads / norms / a shared target
  head untouched, logits and confidences within bf16 rounding of fp32; "auto" only on a CPU with bf16 dot
  products;
* end to end: greedy output with a random DSpark drafter (fp32 or bf16 products) == greedy output
  without a drafter.

    pytest tests/test_dspark_drafter.py -q
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from dspark import kernels

from dspark.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch, ProposeRequest
from dspark.drafters.checkpoint import save_tensors
from dspark.drafters.dspark import DSparkDrafter, build, check, load_dspark, save_dspark
from dspark.drafters.dspark_config import DSparkConfig, dspark_config_for_target
from dspark.drafters.dspark_model import DSparkModel
from dspark.drafters.heads import SEQUENTIAL_HEADS
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

@pytest.mark.parametrize("layout,head", [("dspark", "vanilla"), ("dspark", "rnn"), ("zlab", None)])
def test_paged_incremental_equals_dense(layout, head):
    cfg = tiny_cfg(slot_layout=layout, markov_rank=0 if head is None else 8,
                   markov_head_type=head or "vanilla")
    model = random_model(cfg)
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


def spec(path, *, method="dspark", n=4, **kw):
    return SpecConfig(method=method, model=str(path), num_speculative_tokens=n, **kw)


def test_deepspec_checkpoint_loads_aliases_and_drafts(tmp_path):
    ckpt = write_deepspec_checkpoint(tmp_path / "ds")
    target = random_target()
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
    cfg = tiny_cfg(enable_confidence_head=True, draft_vocab_size=draft_vocab_size, markov_head_type="gated")
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


# -- reduced-precision products (spec "draft_matmul_dtype")

def _drafts_on_shared_context(drafter: DSparkDrafter, num_reqs: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """(base logits [num_reqs, γ, draft_vocab], confidences [num_reqs, γ]) after one context extension;
    6 requests make 36 context rows and 24 block rows, past `Linear.LOWP_MIN_ROWS`."""
    make_pool(drafter, num_blocks=32, kv_block_size=4)
    g = torch.Generator().manual_seed(5)
    taps = torch.randn(6 * num_reqs, len(TAPS) * TARGET.hidden_size, generator=g)
    ids = [torch.randint(3, 120, (7,), generator=g).tolist() for _ in range(num_reqs)]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(num_reqs)]
    drafter.extend_context(ContextUpdate([ContextSegment(f"r{i}", tables[i], 0, ids[i][:6], None,
                                                         slice(6 * i, 6 * i + 6)) for i in range(num_reqs)], taps))
    batch = ProposeBatch([propose_request(f"r{i}", ids[i], 6, tables[i]) for i in range(num_reqs)], 4, "greedy")
    return drafter.forward_blocks(batch)[0], drafter.propose(batch).confidence


def _built_in_dtypes(tmp_path, cfg: DSparkConfig, dtypes: list[str]):
    """(random target, [the same random drafter built with each draft_matmul_dtype]); a reduced vocabulary
    gets a random d2t."""
    target = random_target()
    model = random_model(cfg, seed=2)
    if cfg.draft_vocab_size:
        perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))
        model.reset_buffers(d2t=perm[:cfg.draft_vocab_size])
    save_dspark(model, cfg, tmp_path / "d", dtype="float32")
    kw = dict(target_config=TARGET, target_model=target, dtype=torch.float32, device="cpu")
    return target, [build(spec(tmp_path / "d", draft_matmul_dtype=d), **kw) for d in dtypes]


@pytest.mark.parametrize("draft_vocab_size", [None, 48])
def test_draft_matmul_dtype_bf16_backbone_keeps_heads_and_shared_head(tmp_path, draft_vocab_size):
    cfg = tiny_cfg(enable_confidence_head=True, draft_vocab_size=draft_vocab_size)
    target, (f32, b16) = _built_in_dtypes(tmp_path, cfg, ["float32", "bfloat16"])
    m = b16.model
    backbone = [m.fc, m.layers[0].self_attn.q_proj, m.layers[1].self_attn.o_proj, m.layers[0].mlp.down_proj]
    assert all(lin.lowp_weight.dtype == torch.bfloat16 for lin in backbone)
    assert all(p.dtype == torch.float32 for p in m.parameters()), "the weights themselves stay fp32"
    assert not any(hasattr(lin, "lowp_weight") for lin in f32.model.modules())
    heads = [*m.markov_head.modules(), *m.confidence_head.modules()]
    assert not any(hasattr(lin, "lowp_weight") for lin in heads), "the heads keep their products"
    assert "lowp_weight" not in "".join(m.state_dict()), "the copies are not part of the checkpoint"
    if draft_vocab_size is None:  # the target's own head: aliased, not copied to bf16
        assert m.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
        assert not hasattr(m.lm_head, "lowp_weight")
    else:
        assert m.lm_head.lowp_weight.dtype == torch.bfloat16
    logits32, conf32 = _drafts_on_shared_context(f32)
    logits16, conf16 = _drafts_on_shared_context(b16)
    assert logits16.dtype == torch.float32 and conf16.dtype == torch.float32
    assert not torch.equal(logits16, logits32), "the bf16 products were not used"
    # 4 block rows: with bf16 kernels (dot products, or AVX2's widening of the weights) bf16 products too
    one32, _ = _drafts_on_shared_context(f32, num_reqs=1)
    one16, _ = _drafts_on_shared_context(b16, num_reqs=1)
    assert torch.equal(one16, one32) != (kernels.has_bf16_kernels() or kernels.has_bf16w_kernels())
    assert (one16 - one32).abs().max() <= 0.03 * one32.abs().max()
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 per product input, a few products deep)
    assert (logits16 - logits32).abs().max() <= 0.03 * logits32.abs().max()
    assert (conf16 - conf32).abs().max() <= 0.03


def q4_cfg(**overrides) -> DSparkConfig:
    """tiny_cfg with an MLP width the Q4_1 products take (input widths in multiples of 32)."""
    return dataclasses.replace(tiny_cfg(**overrides), intermediate_size=64)


@pytest.mark.skipif(kernels.has_bf16w_kernels(), reason="AVX2 builds multiply many rows with the fp32 weight")
def test_many_row_bf16_products_take_bucketed_shapes(monkeypatch):
    """Products past the kernels (torch's bf16, whose oneDNN builds a primitive for every new shape) pad
    their rows to a few sizes: at most four an octave, padding <= 25% from 64 rows on; each output row is
    its own row's product."""
    sizes = {kernels.row_bucket(r) for r in range(1, 4097)}
    assert all(kernels.row_bucket(r) >= r for r in range(1, 4097))
    assert all(kernels.row_bucket(r) <= 1.25 * r for r in range(64, 4097))
    assert len(sizes) <= 4 * 7, sorted(sizes)  # 16 .. 4096: four an octave
    lin = kernels.Linear(96, 40, bias=True)
    kernels.set_matmul_dtype(lin, torch.bfloat16)
    seen = []
    real = kernels.F.linear
    monkeypatch.setattr(kernels.F, "linear", lambda x, w, b=None: seen.append(x.shape[0]) or real(x, w, b))
    g = torch.Generator().manual_seed(4)
    for rows in (kernels.MAX_ROWS + 1, 251, 298, 300):
        x = torch.randn(rows, 96, generator=g)
        with torch.inference_mode():
            out = lin(x)
        ref = (x.bfloat16().double() @ lin.lowp_weight.double().t() + lin.bias.bfloat16().double()).float()
        assert out.shape == (rows, 40) and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)  # bf16 output rounding
    assert seen == [160, 256, 320, 320], seen
    if kernels.has_bf16_kernels():  # where oneDNN's AMX tiles win (`bf16_kernel_rows`): torch past 16 rows
        monkeypatch.setattr(kernels, "BF16_KERNEL_ROWS", 16)
        seen.clear()
        with torch.inference_mode():
            lin(torch.randn(16, 96, generator=g)), lin(torch.randn(17, 96, generator=g))
        assert seen == [32], seen


@pytest.mark.skipif(not kernels.has_q4_1_kernels(), reason="no Q4_1 CPU kernels (AVX2/FMA/F16C)")
def test_draft_matmul_dtype_q4_1_quantizes_the_backbone_and_keeps_heads(tmp_path, monkeypatch):
    """"q4_1": the backbone's matrices and a reduced-vocab head become Q4_1 blocks (gguf's quantizer), the
    weights their values; the heads keep theirs; each product is the kernels' Q4_1 x Q8_1 product (the
    twin: the input's Q8_1 values times the blocks' values), and the whole proposal equals the drafter run
    through those twins. A width the kernels cannot take is refused, naming the layer."""
    import gguf
    cfg = q4_cfg(enable_confidence_head=True, draft_vocab_size=48)
    target, (f32, q4) = _built_in_dtypes(tmp_path, cfg, ["float32", "q4_1"])
    kw = dict(target_config=TARGET, target_model=target, dtype=torch.float32, device="cpu")
    m = q4.model
    backbone = [m.fc, m.layers[0].self_attn.q_proj, m.layers[1].self_attn.o_proj, m.layers[0].mlp.down_proj, m.lm_head]
    assert all(lin.lowp_weight.dtype == torch.uint8 for lin in backbone)
    heads = [*m.markov_head.modules(), *m.confidence_head.modules()]
    assert not any(hasattr(lin, "lowp_weight") for lin in heads), "the heads keep their products"
    fp32_down = f32.model.layers[0].mlp.down_proj.weight
    raw = gguf.quantize(fp32_down.detach().numpy(), gguf.GGMLQuantizationType.Q4_1)
    assert torch.equal(m.layers[0].mlp.down_proj.weight,
                       torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).copy()))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    down = m.layers[0].mlp.down_proj
    ref = (kernels.q8_1_dequantized(x).double() @ down.weight.double().t()).float()
    with torch.inference_mode():  # (with autograd the module trains on the blocks' values in fp32)
        torch.testing.assert_close(down(x), ref, rtol=1e-5, atol=1e-5)
    logits32, _ = _drafts_on_shared_context(f32)
    logits4, conf4 = _drafts_on_shared_context(q4)
    assert not torch.equal(logits4, logits32), "the Q4_1 products were not used"
    # the slow twin: every product through torch (the input's Q8_1 values times the blocks' values)
    original = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda x, w, **k: None if w.dtype == torch.uint8 else original(x, w, **k))
    monkeypatch.setattr(m, "fused_backbone", lambda *a, **k: None)
    twin_logits, twin_conf = _drafts_on_shared_context(q4)
    torch.testing.assert_close(logits4, twin_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf4, twin_conf, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    narrow = tiny_cfg()  # intermediate 48: down_proj's input is no multiple of 32
    save_dspark(random_model(narrow), narrow, tmp_path / "n", dtype="float32")
    with pytest.raises(ValueError, match="down_proj is .*multiples of 32"):
        build(spec(tmp_path / "n", draft_matmul_dtype="q4_1"), **kw)


@pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("draft_matmul_dtype", ["float32", "bfloat16", "q4_1"])
def test_fused_block_forward_matches_the_module_path(tmp_path, monkeypatch, draft_matmul_dtype):
    """The block forward in one fused-stack call (`DSparkModel.fused_backbone`: the block's K/V stored
    past each context, key limits instead of a mask) against the module path over the gathered context,
    for three requests with contexts of 5, 9 and 2 positions: logits and hidden within the kernel's
    attention / RoPE rounding, the same drafts and confidences; the context slots are untouched. A request
    whose block table ends before its block's last position takes the module path for the whole batch;
    more block rows than a kernel call takes run as several calls of whole blocks."""
    if draft_matmul_dtype == "bfloat16" and not (kernels.has_bf16_kernels() or kernels.has_bf16w_kernels()):
        pytest.skip("no bf16 products on this CPU")
    if draft_matmul_dtype == "q4_1" and not kernels.has_q4_1_kernels():
        pytest.skip("no Q4_1 products on this CPU")
    cfg = (q4_cfg if draft_matmul_dtype == "q4_1" else tiny_cfg)(enable_confidence_head=True)
    save_dspark(random_model(cfg, seed=4), cfg, tmp_path / "d", dtype="bfloat16")
    drafter = build(spec(tmp_path / "d", draft_matmul_dtype=draft_matmul_dtype), target_config=TARGET,
                    target_model=random_target(), dtype=torch.float32, device="cpu")
    make_pool(drafter, num_blocks=16, kv_block_size=4)
    g = torch.Generator().manual_seed(6)
    ctx = [5, 9, 2]
    ids = [torch.randint(3, 120, (12,), generator=g).tolist() for _ in ctx]
    tables = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]  # each covers its block (anchor + block_size <= 4 * len)
    taps = torch.randn(sum(ctx), len(TAPS) * TARGET.hidden_size, generator=g)
    starts = [0, 5, 14]
    drafter.extend_context(ContextUpdate([ContextSegment(f"r{i}", tables[i], 0, ids[i][:n], None,
                                                         slice(starts[i], starts[i] + n)) for i, n in enumerate(ctx)], taps))
    context = [(k.clone(), v.clone()) for k, v in drafter.kv_caches]
    batch = ProposeBatch([propose_request(f"r{i}", ids[i], n, tables[i]) for i, n in enumerate(ctx)], 4, "greedy")
    ran = []
    original = kernels.decoder_layers
    monkeypatch.setattr(kernels, "decoder_layers", lambda *a, **k: ran.append(True) or original(*a, **k))
    fused_logits, fused_hidden, _ = drafter.forward_blocks(batch)
    fused = drafter.propose(batch)
    assert len(ran) == 2, "the fused stack did not run"
    with monkeypatch.context() as m:  # more block rows than one call takes: calls of whole blocks, same rows
        m.setattr(kernels, "MAX_ROWS", 2 * cfg.block_size)
        assert torch.equal(drafter.forward_blocks(batch)[1], fused_hidden) and len(ran) == 4
    for (k0, v0), (k1, v1) in zip(context, drafter.kv_caches):
        for i, n in enumerate(ctx):
            for pos in range(n):
                slot = (tables[i][pos // 4], pos % 4)
                assert torch.equal(k0[slot], k1[slot]) and torch.equal(v0[slot], v1[slot])
    monkeypatch.setattr(drafter.model, "fused_backbone", lambda *a, **k: None)
    module_logits, module_hidden, _ = drafter.forward_blocks(batch)
    module = drafter.propose(batch)
    torch.testing.assert_close(fused_logits, module_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_hidden, module_hidden, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused.draft_ids, module.draft_ids)
    torch.testing.assert_close(fused.confidence, module.confidence, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    short = ProposeBatch([*batch.requests[:2], propose_request("r2", ids[2], 2, tables[2][:1])], 4, "greedy")
    ran.clear()
    monkeypatch.setattr(kernels, "decoder_layers", lambda *a, **k: ran.append(True) or original(*a, **k))
    assert torch.equal(drafter.propose(short).draft_ids, module.draft_ids) and not ran


def test_draft_matmul_dtype_auto_and_validation(monkeypatch):
    from dspark.drafters import dspark as dspark_mod

    resolve = dspark_mod.resolve_matmul_dtype
    for has_bf16, widens, expected in ((True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                       (False, False, torch.float32)):
        monkeypatch.setattr(dspark_mod, "cpu_has_bf16_dot", lambda: has_bf16)
        monkeypatch.setattr(dspark_mod, "has_bf16w_kernels", lambda: widens)  # AVX2's widening bf16 path
        assert resolve("auto", dtype=torch.float32, device="cpu") == expected
    assert resolve("auto", dtype=torch.float32, device="cuda:0") == torch.float32  # no change on CUDA
    assert resolve("auto", dtype=torch.bfloat16, device="cpu") == torch.bfloat16
    assert resolve("float32", dtype=torch.bfloat16, device="cpu") == torch.float32
    with pytest.raises(ValueError, match="draft_matmul_dtype"):
        SpecConfig(method="dspark", model="x", draft_matmul_dtype="int8")
    assert SpecConfig(method="dspark", model="x", draft_matmul_dtype="q4_1").draft_matmul_dtype == "q4_1"
    assert resolve("q4_1", dtype=torch.float32, device="cpu") == torch.uint8  # Q4_1 blocks


# -- end to end

@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_engine_greedy_parity_with_random_dspark(tmp_path, matmul_dtype):
    from dspark.engine.engine import Engine

    target = random_target(seed=7)
    cfg = tiny_cfg(enable_confidence_head=True)
    save_dspark(random_model(cfg, seed=3), cfg, tmp_path / "d", dtype="float32")
    prompts = [[1, 17, 33, 60, 5, 9, 88, 21, 40], [1, 90, 4], list(range(3, 40))]

    def run(spec_config):
        config = EngineConfig(spec=spec_config, cache=CacheConfig(kv_block_size=4, num_kv_blocks=96),
                              scheduler=SchedulerConfig(max_num_batched_tokens=24))
        drafter = None if spec_config is None else build(spec_config, target_config=TARGET, target_model=target,
                                                         dtype=torch.float32, device="cpu")
        engine = Engine(config, model=target, model_config=TARGET, drafter=drafter)
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
               for p in prompts]
        out = {i: [] for i in ids}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return [out[i] for i in ids], engine

    plain, _ = run(None)
    spec_out, engine = run(SpecConfig(method="dspark", model=str(tmp_path / "d"), num_speculative_tokens=4,
                                      draft_matmul_dtype=matmul_dtype))
    assert spec_out == plain
    assert engine.metrics.verify_lens, "the drafter never proposed"
