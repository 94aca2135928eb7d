"""The DSpark drafter's reduced-precision products (spec "draft_matmul_dtype") and its end-to-end greedy
parity: bf16 products keep heads, norms and a shared target head untouched, within bf16 rounding of fp32;
many-row bf16 products take bucketed shapes; q4_1 quantizes the backbone and keeps the heads; the fused
block forward matches the module path; "auto" only on a CPU with bf16 dot products; greedy output with a
random DSpark drafter (fp32 or bf16 products) == greedy output without a drafter.

    pytest tests/test_dspark_drafter_dtypes.py -q
"""


from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dspark import kernels

from dspark.config import SpecConfig
from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch
from dspark.drafters.dspark import DSparkDrafter, build, save_dspark
from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.dspark_fused import stacked_rows
from tests.dspark_helpers import (TAPS, TARGET, greedy_engine_run, make_pool, propose_request, random_model,
                                  random_target, spec, tiny_cfg)


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
def test_draft_matmul_dtype_bf16_backbone_keeps_heads_and_shared_head(tmp_path, monkeypatch, draft_vocab_size):
    cfg = tiny_cfg(enable_confidence_head=True, draft_vocab_size=draft_vocab_size)
    target, (f32, b16) = _built_in_dtypes(tmp_path, cfg, ["float32", "bfloat16"])
    m = b16.model
    backbone = [m.fc, m.layers[0].self_attn.q_proj, m.layers[1].self_attn.o_proj, m.layers[0].mlp.down_proj]
    assert all(lin.lowp_weight.dtype == torch.bfloat16 for lin in backbone)
    assert all(p.dtype == torch.float32 for p in m.parameters()), "the weights kept stay fp32"
    bf16_kernels = kernels.has_bf16_kernels() or kernels.has_bf16w_kernels()  # dot products, or AVX2's widening
    if bf16_kernels:
        assert all(lin.weight is None for lin in backbone), "an engine's drafter keeps only the bf16 copies"
    else:  # AVX-512 without BF16, kernels off: no kernel multiplies the copies, the few-row products take fp32
        assert all(lin.weight is not None for lin in backbone), "the fp32 weights serve the few-row products"
    assert all(lin.weight is not None for lin in m.markov_head.modules() if isinstance(lin, kernels.Linear))
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
    # 4 block rows: with bf16 kernels (dot products, or AVX2's widening of the weights) bf16 products too;
    # without them the fp32 weights' products op by op (no one-call path takes the bf16 copies), bit for bit
    # the fp32 drafter's op-by-op path (its one-call paths round RoPE and attention their own way)
    one16, _ = _drafts_on_shared_context(b16, num_reqs=1)
    with monkeypatch.context() as mp:
        mp.setattr(f32.model, "fused_backbone", lambda *a, **k: None)
        mp.setattr(f32.model, "fused_context_kv", lambda *a, **k: None)
        mp.setattr(f32, "_fused_proposal", lambda batch: None)
        one32, _ = _drafts_on_shared_context(f32, num_reqs=1)
    assert torch.equal(one16, one32) != bf16_kernels
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
    assert m.layers[0].mlp.down_proj.weight is None, "the blocks alone stay"
    assert torch.equal(m.layers[0].mlp.down_proj.dense_weight(),
                       torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).copy()))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    down = m.layers[0].mlp.down_proj
    ref = (kernels.q8_1_dequantized(x).double() @ down.dense_weight().double().t()).float()
    with torch.inference_mode():  # (with autograd the module trains on the blocks' values in fp32)
        torch.testing.assert_close(down(x), ref, rtol=1e-5, atol=1e-5)
    logits32, _ = _drafts_on_shared_context(f32)
    logits4, conf4 = _drafts_on_shared_context(q4)
    assert not torch.equal(logits4, logits32), "the Q4_1 products were not used"
    # the slow twin: every product through torch (the input's Q8_1 values times the blocks' values)
    original = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda x, w, **k: None if w.dtype == torch.uint8 else original(x, w, **k))
    monkeypatch.setattr(m, "fused_backbone", lambda *a, **k: None)
    monkeypatch.setattr(m, "fused_context_kv", lambda *a, **k: None)  # the one-call paths multiply in C++
    monkeypatch.setattr(q4, "_fused_proposal", lambda batch: None)
    twin_logits, twin_conf = _drafts_on_shared_context(q4)
    torch.testing.assert_close(logits4, twin_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf4, twin_conf, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    narrow = tiny_cfg()  # intermediate 48: down_proj's input is no multiple of 32
    save_dspark(random_model(narrow), narrow, tmp_path / "n", dtype="float32")
    with pytest.raises(ValueError, match="down_proj is .*multiples of 32"):
        build(spec(tmp_path / "n", draft_matmul_dtype="q4_1"), **kw)
    # "auto" (the default) takes Q4_1 where the shapes allow it, and the next choice where they do not
    save_dspark(random_model(cfg), cfg, tmp_path / "q", dtype="float32")
    auto = build(spec(tmp_path / "q", draft_matmul_dtype="auto"), **kw)
    assert auto.model.layers[0].mlp.down_proj.lowp_weight.dtype == torch.uint8
    narrow_auto = build(spec(tmp_path / "n", draft_matmul_dtype="auto"), **kw).model.layers[0].mlp.down_proj
    assert getattr(narrow_auto, "lowp_weight", narrow_auto.weight).dtype != torch.uint8


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
    monkeypatch.setattr(drafter, "_fused_proposal", lambda batch: None)  # the proposal op by op over the fused stack
    fused = drafter.propose(batch)
    assert len(ran) == 2, "the fused stack did not run"
    if draft_matmul_dtype != "float32":  # the stack reads each layer's packed copies in place, no second copy
        layer, weights = drafter.model.layers[1], drafter.model._fused_weights()[8:16]
        a, mlp = layer.self_attn, layer.mlp
        for stacked, parts in ((weights[1], (a.q_proj, a.k_proj, a.v_proj)), (weights[4], (a.o_proj,)),
                               (weights[6], (mlp.gate_proj, mlp.up_proj)), (weights[7], (mlp.down_proj,))):
            assert stacked.data_ptr() == parts[0].lowp_weight.data_ptr()
            assert torch.equal(stacked, torch.cat([m.lowp_weight for m in parts]))
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


def test_stacked_rows_is_a_view_only_of_adjacent_row_ranges():
    base = torch.randn(10, 4)
    parts = [base[0:3], base[3:4], base[4:10]]
    view = stacked_rows(parts)
    assert torch.equal(view, base) and view.data_ptr() == base.data_ptr()
    for apart in ([base[0:3], base[4:10]], [base[3:4], base[0:3]], [base[0:3], torch.randn(2, 4)]):
        out = stacked_rows(apart)
        assert torch.equal(out, torch.cat(apart)) and out.data_ptr() != base.data_ptr()
    assert stacked_rows([base[2:5]]).data_ptr() == base[2:5].data_ptr()  # one contiguous matrix: itself


@pytest.mark.parametrize("dtype", ["bfloat16", "q4_1"])
def test_a_released_linear_serves_every_row_count_from_its_copy(monkeypatch, dtype):
    """`release_dense_weights` frees the fp32 weight of a Linear holding a low-precision copy the kernels
    multiply; at every row count (the kernels' and torch's ranges) its inference products equal the
    unreleased module's where both read the copy, and the fp32 products of the copy's values otherwise; the
    path no kernel serves dequantizes the copy (`dense_weight`). Where no kernel multiplies a bf16 copy
    (AVX-512 without BF16, kernels off) the weight stays, and the few-row products are the fp32 weight's."""
    if dtype == "q4_1" and not kernels.has_q4_1_kernels():
        pytest.skip("no Q4_1 products on this CPU")
    lin = kernels.Linear(64, 40, bias=True)
    if dtype == "q4_1":
        kernels.set_q4_1_products(lin)
    else:
        kernels.set_matmul_dtype(lin, torch.bfloat16)
    kept = copy.deepcopy(lin)
    served = dtype == "q4_1" or kernels.has_bf16_kernels() or kernels.has_bf16w_kernels()
    if served:
        assert kernels.release_dense_weights(lin) == 40 * 64 * 4 and lin.weight is None
    else:
        assert kernels.release_dense_weights(lin) == 0 and torch.equal(lin.weight, kept.weight)
    values = kept.weight if dtype == "q4_1" else kept.lowp_weight.float()
    dense = values if served else kept.weight  # what a product no kernel serves multiplies
    assert torch.equal(lin.dense_weight(), dense)
    g = torch.Generator().manual_seed(8)
    for rows in (1, 16, 17, kernels.MAX_ROWS + 3):
        x = torch.randn(rows, 64, generator=g)
        with torch.inference_mode():
            out, ref = lin(x), kept(x)
        if dtype == "q4_1" or rows <= kernels.bf16_kernel_rows() or not kernels.has_bf16w_kernels():
            assert torch.equal(out, ref), rows  # the same copy through the same path
        if not served and rows <= kernels.Linear.LOWP_MIN_ROWS:  # the fp32 weight's product, not the copy's
            torch.testing.assert_close(out, (x.double() @ dense.double().t()).float() + lin.bias, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, x @ values.t() + lin.bias, rtol=3e-2, atol=3e-2)  # input rounding
    monkeypatch.setattr(kernels, "linear", lambda *a, **k: None)  # no kernel: torch on the copy's values
    x = torch.randn(3, 64, generator=g)
    with torch.inference_mode():
        twin = kernels.q8_1_dequantized(x) if dtype == "q4_1" else x
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(twin, dense, lin.bias), rtol=0, atol=1e-6)


def test_draft_matmul_dtype_auto_and_validation(monkeypatch):
    from dspark.drafters import dspark as dspark_mod

    resolve = dspark_mod.resolve_matmul_dtype
    monkeypatch.setattr(dspark_mod, "has_q4_1_kernels", lambda: True)
    assert resolve("auto", dtype=torch.float32, device="cpu") == torch.uint8  # Q4_1 where the kernels take it
    assert resolve("auto", dtype=torch.bfloat16, device="cpu") == torch.bfloat16  # not for a bf16 engine
    monkeypatch.setattr(dspark_mod, "cpu_has_bf16_dot", lambda: True)
    assert resolve("auto", dtype=torch.float32, device="cpu", q4_1_fits=False) == torch.bfloat16  # shapes it can't hold
    monkeypatch.setattr(dspark_mod, "has_q4_1_kernels", lambda: False)
    for has_bf16, widens, expected in ((True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                       (False, False, torch.float32)):
        monkeypatch.setattr(dspark_mod, "cpu_has_bf16_dot", lambda: has_bf16)
        monkeypatch.setattr(dspark_mod, "has_bf16w_kernels", lambda: widens)  # AVX2's widening bf16 path
        assert resolve("auto", dtype=torch.float32, device="cpu") == expected
    monkeypatch.setattr(dspark_mod, "has_q4_1_kernels", lambda: True)
    assert resolve("auto", dtype=torch.float32, device="cuda:0") == torch.float32  # no change on CUDA
    assert resolve("auto", dtype=torch.bfloat16, device="cpu") == torch.bfloat16
    assert resolve("float32", dtype=torch.bfloat16, device="cpu") == torch.float32
    with pytest.raises(ValueError, match="draft_matmul_dtype"):
        SpecConfig(method="dspark", model="x", draft_matmul_dtype="int8")
    assert SpecConfig(method="dspark", model="x", draft_matmul_dtype="q4_1").draft_matmul_dtype == "q4_1"
    assert resolve("q4_1", dtype=torch.float32, device="cpu") == torch.uint8  # Q4_1 blocks


# -- end to end

@pytest.mark.parametrize("matmul_dtype,anchor", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_engine_greedy_parity_with_random_dspark(tmp_path, matmul_dtype, anchor):
    target = random_target(seed=7)
    cfg = tiny_cfg(enable_confidence_head=True, anchor_features=anchor)
    save_dspark(random_model(cfg, seed=3), cfg, tmp_path / "d", dtype="float32")
    plain, _ = greedy_engine_run(target, None)
    spec_config = SpecConfig(method="dspark", model=str(tmp_path / "d"), num_speculative_tokens=4,
                             draft_matmul_dtype=matmul_dtype)
    spec_out, engine = greedy_engine_run(target, spec_config)
    assert spec_out == plain
    assert engine.metrics.verify_lens, "the drafter never proposed"



@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_markov_rows_held_in_bf16_read_the_same_values(tmp_path, head_type):
    """An engine's drafter holds a bf16 checkpoint's Markov W1 (a row per target token) as bf16, its rows read
    back in fp32: the same embeddings, block logits and proposals bit for bit as the fp32 rows; W1 values that
    bf16 would round stay fp32."""
    cfg = tiny_cfg(markov_head_type=head_type)
    model = random_model(cfg, seed=3)
    assert model.markov_head.hold_rows_bf16() == 0 and model.markov_head.markov_w1.weight.dtype == torch.float32
    save_dspark(model, cfg, tmp_path / "d", dtype="bfloat16")
    kw = dict(target_config=TARGET, target_model=random_target(), dtype=torch.float32, device="cpu")
    held = build(spec(tmp_path / "d", draft_matmul_dtype="float32"), **kw)
    full = build(spec(tmp_path / "d", draft_matmul_dtype="float32"), **kw)
    head = full.model.markov_head
    head.markov_w1.weight = torch.nn.Parameter(head.markov_w1.weight.float(), requires_grad=False)
    head.rows_dtype = None  # the fp32 twin: the checkpoint's values as fp32 rows
    w1 = held.model.markov_head.markov_w1.weight
    assert w1.dtype == torch.bfloat16 and torch.equal(w1.float(), head.markov_w1.weight)
    ids = torch.randint(0, cfg.vocab_size, (5, 3))
    assert torch.equal(held.model.markov_head.embed_prev(ids), head.embed_prev(ids))
    assert held.model.markov_head.embed_prev(ids).dtype == torch.float32
    logits_a, conf_a = _drafts_on_shared_context(held)
    logits_b, conf_b = _drafts_on_shared_context(full)
    assert torch.equal(logits_a, logits_b) and torch.equal(conf_a, conf_b)


def test_fused_weights_follow_a_weight_changed_in_place_or_replaced():
    """The fused stack's weight list is cached while its tensors stay as they are, and rebuilt when one is
    updated in place (a training step) or replaced (a new low-precision copy)."""
    model = random_model(tiny_cfg(), seed=2)
    first = model._fused_weights()
    assert first is not None and model._fused_weights() is first
    down = model.layers[0].mlp.down_proj
    with torch.no_grad():
        down.weight.add_(1.0)
    second = model._fused_weights()
    assert second is not first and torch.equal(second[7], down.weight)
    down.register_buffer("lowp_weight", down.weight.detach() * 2, persistent=False)
    assert torch.equal(model._fused_weights()[7], down.weight * 2)
