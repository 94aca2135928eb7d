"""GGUF weights resident as quantized (`--matmul-dtype gguf`, dspark.models.blocks) and the products on the
native blocks:

* each native-block product (Q4_1, Q8_0 x fp32 in cpu_ops.cpp; Q5_0, Q4_K, Q6_K and Q8_0 x Q8_0, the resident
  model's Q8_0 product, in cpu_ops_blocks.inc) bit for bit equal to its torch twin that dequantizes the same blocks
  and repeats the kernel's arithmetic (`kernels.blocks`, `kernels.ggml.product_reference`,
  `kernels.ggml.q8_0_product_reference`), on this build and on the AVX2 build (`ops_variant`);
* the fields the kernels read are gguf's weights (the blocks' values equal gguf's dequantization);
* a small synthetic GGUF (written with the `gguf` package) in every listed type loads resident as quantized:
  no dense weight kept, every product equals its own reference on the input it got, and the logits stay
  with the dequantized fp32 model's (apart by the inputs' quantization only).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from dspark import kernels  # noqa: E402
from dspark.kernels import blocks as qb  # noqa: E402
from dspark.kernels import ggml  # noqa: E402
from dspark.models.blocks import Q8_0X8  # noqa: E402

T = gguf.GGMLQuantizationType
needs_kernels = pytest.mark.skipif(ggml.ops() is None, reason="no block kernels (AVX2/FMA/F16C, kernels on)")
# fp16 fields of the K types (offsets in the block) and the scale that gives weights of ~0.05 with the
# types' integer ranges, which random blocks must hold
_HALF_FIELDS = {T.Q4_K: ((0, 2), 1e-4), T.Q5_K: ((0, 2), 5e-5), T.Q6_K: ((208,), 1.5e-5), T.Q3_K: ((108,), 4e-4),
                T.Q2_K: ((80, 82), 1e-3)}


def gguf_rows(n: int, k: int, qtype, *, seed: int) -> torch.Tensor:
    """GGUF rows [n, row bytes] of a random matrix in `qtype`: gguf's quantizer where it has one, else random
    blocks (K types) with small positive scales."""
    rng = np.random.default_rng(seed)
    if qtype not in _HALF_FIELDS:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
        data = gguf.quantize(w, qtype)
        return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(n, -1))
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n, k // block_weights, block_bytes), dtype=np.uint8)
    offsets, scale = _HALF_FIELDS[qtype]
    for off in offsets:
        half = (rng.random((n, k // block_weights), dtype=np.float32) * scale + scale / 4).astype(np.float16)
        b[..., off:off + 2] = half.view(np.uint8).reshape(n, k // block_weights, 2)
    return torch.from_numpy(b.reshape(n, -1))


# ------------------------------------------------------------------------------------- the products


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_block_product_is_bitwise_its_twin_on_both_builds(qtype, rows):
    raw = gguf_rows(40, 512, qtype, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # an all-zero block of the input
    ref = ggml.product_reference(x, raw, qtype)
    assert torch.equal(ggml.product(x, raw, qtype), ref)
    assert torch.equal(ggml.ops_variant("DSPARK_QUANT_AVX2").block_mm(x, raw, int(qtype)), ref)
    # the twins are the blocks' model: the fast twin within summation order, the unquantized input far off
    fast = ggml.block_linear(x, raw, qtype)
    dense = x @ ggml.dequantize(raw, qtype).t()
    assert (fast - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item())
    assert (dense - ref).abs().max() > 10 * (fast - ref).abs().max()


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_the_kernels_fields_are_gguf_s_weights(qtype):
    raw = gguf_rows(16, 512, qtype, seed=3)
    assert torch.equal(ggml.block_values(raw, qtype), ggml.dequantize(raw, qtype))


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_q5_0_decode_rows_in_pairs_with_odd_counts_and_short_groups(threads):
    """One input row takes the weight rows two at a time: an odd count of rows (and thread shares starting at
    odd rows) and 19 blocks a row (two groups of 8, then single blocks) stay bit for bit the twin's."""
    raw = gguf_rows(41, 608, T.Q5_0, seed=3)
    x = torch.randn(1, 608, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, avx2 = ggml.product(x, raw, T.Q5_0), ggml.ops_variant("DSPARK_QUANT_AVX2").block_mm(x, raw, int(T.Q5_0))
    finally:
        torch.set_num_threads(before)
    ref = ggml.product_reference(x, raw, T.Q5_0)
    assert torch.equal(out, ref) and torch.equal(avx2, ref)


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [3, 8, 17])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_k_quant_products_over_long_rows_and_partial_groups(qtype, rows, threads):
    """The K-quant paths (row by row in chunks of input rows, long rows: K = 6144 keeps 14 input rows a chunk; 8
    weight rows tiled from 8 input rows on AVX512-VNNI builds) on 21 output rows (a group of 8 cut by the
    threads' shares and a short last group): bit for bit the twin on both builds."""
    raw = gguf_rows(21, 6144, qtype, seed=rows)
    x = torch.randn(rows, 6144, generator=torch.Generator().manual_seed(rows))
    ref = ggml.product_reference(x, raw, qtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(ggml.product(x, raw, qtype), ref)
        assert torch.equal(ggml.ops_variant("DSPARK_QUANT_AVX2").block_mm(x, raw, int(qtype)), ref)
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 23])
@pytest.mark.parametrize("threads", [1, 3])
def test_q4_k_rows_packed_by_16_are_bitwise_the_file_rows(rows, threads):
    """`ggml.pack_k16` (AVX-512 VNNI builds): the packing round-trips byte for byte, and the packed product over
    48 output rows (3 groups, cut by the threads' shares) is bit for bit the twin on the file's rows, from one
    input row (decode) to prompt-sized ones. A build without the packed product refuses the form by name."""
    raw = gguf_rows(48, 1536, T.Q4_K, seed=rows)
    packed = ggml.pack_k16(raw)
    assert packed.shape == (48, 1536 // 256 * 148) and torch.equal(ggml.unpack_k16(packed), raw)
    assert torch.equal(ggml.dequantize(ggml.unpack_k16(packed), T.Q4_K), ggml.block_values(raw, T.Q4_K))
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
    if ggml.k_group_rows() != 16:
        with pytest.raises(RuntimeError, match="no product in this build"):
            ggml.ops().block_mm(x, packed, ggml.Q4_KX16)
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(ggml.product(x, packed, ggml.Q4_KX16), ggml.product_reference(x, raw, T.Q4_K))
    finally:
        torch.set_num_threads(before)
    assert ggml.packable(raw, T.Q4_K) and not ggml.packable(raw[:40], T.Q4_K)  # whole groups only
    assert not ggml.packable(gguf_rows(48, 1536, T.Q6_K, seed=1), T.Q6_K)


@needs_kernels
def test_a_block_product_row_does_not_depend_on_the_batch():
    raw = gguf_rows(24, 256, T.Q4_K, seed=4)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([ggml.product(x[i:i + 1], raw, T.Q4_K) for i in range(9)])
    assert torch.equal(ggml.product(x, raw, T.Q4_K), alone)


@pytest.mark.skipif(not kernels.has_q4_1_kernels(), reason="no Q4_1 CPU kernels")
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_q4_1_product_is_bitwise_its_twin_on_both_builds(rows):
    raw = gguf_rows(40, 576, T.Q4_1, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    packed = kernels.pack_q4_1(raw)
    assert torch.equal(kernels.ops().small_mm(x, packed), qb.q4_1_product_reference(x, packed))
    assert torch.equal(qb.unpack_q4_1(packed), raw) and torch.equal(qb.q4_1_packed_values(packed), ggml.dequantize(raw, T.Q4_1))
    if kernels.q4_1_group_rows() == 16:  # the AVX2 tiles read the 8-row packing
        avx2 = kernels.ops_variant("DSPARK_Q4_NO_VNNI")
        assert torch.equal(avx2.small_mm(x, kernels.pack_q4_1(raw, group_rows=8)), qb.q4_1_product_reference(x, packed))


@pytest.mark.skipif(not kernels.has_q8_0_kernels(), reason="no Q8_0 CPU kernels")
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_q8_0_product_is_bitwise_its_twin(rows):
    raw = gguf_rows(40, 576, T.Q8_0, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    packed = kernels.pack_q8_0(raw)
    assert torch.equal(kernels.ops().small_mm(x, packed), qb.q8_0_product_reference(x, packed))
    assert torch.equal(qb.q8_0_packed_values(packed), ggml.dequantize(raw, T.Q8_0))


@needs_kernels
@pytest.mark.parametrize("rows,k,n", [(1, 640, 40), (1, 576, 32), (3, 256, 24), (4, 32, 16), (5, 1024, 16),
                                      (9, 640, 800)])
def test_q8_0_x_q8_0_product_is_bitwise_its_twin_on_both_builds(rows, k, n):
    """K of 8 blocks a group and of short last groups (576: 8 + 8 + 2, 640: 8 + 8 + 4); odd and even input row
    counts (rows go two at a time); the rows interleaved by 8 (`pack_q8_0x8`) hold the same values as the
    plain packing, read whole or by row ids (the embedding's lookups)."""
    raw = gguf_rows(n, k, T.Q8_0, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0  # an all-zero block: e = 0
    packed = qb.pack_q8_0x8(raw)
    values = qb.q8_0_packed_values(kernels.pack_q8_0(raw))
    assert torch.equal(qb.q8_0x8_values(packed), values)
    ids = torch.tensor([n - 1, 0, 5, 5])
    assert torch.equal(qb.q8_0x8_values(packed, ids), values[ids])
    ref = ggml.q8_0_product_reference(x, packed)
    assert torch.equal(ggml.q8_0_product(x, packed), ref)
    assert torch.equal(ggml.ops_variant("DSPARK_QUANT_AVX2").q8_0_mm(x, packed), ref)
    alone = torch.cat([ggml.q8_0_product(x[i:i + 1], packed) for i in range(rows)])
    assert torch.equal(alone, ref)  # a row's result does not depend on the batch
    fast = ggml.q8_0_block_linear(x, packed)  # the input's Q8_0 values times the weights: summation order only
    dense = x @ values.t()  # the unquantized input: the input rounding's effect
    assert (fast - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item())
    assert (dense - ref).abs().max() > 10 * (fast - ref).abs().max()
    with pytest.raises(ValueError, match="groups of 8"):
        qb.pack_q8_0x8(raw[:n - 1])


@needs_kernels
def test_a_q8_0_head_of_rows_not_in_groups_of_8_keeps_the_plain_packing():
    """An embedding / tied head of 33 rows cannot interleave by 8: its rows keep `pack_q8_0`'s layout, lookups
    read them, and the head multiplies the fp32 input (the layers' Q8_0 product)."""
    from dspark.models.blocks import Q8_0, BlockRows
    raw = gguf_rows(33, 256, T.Q8_0, seed=4)
    rows = BlockRows(int(T.Q8_0), raw, 256)
    assert rows.qtype == Q8_0 and torch.equal(rows.data, kernels.pack_q8_0(raw))
    assert torch.equal(rows.lookup(torch.tensor([32, 1])), ggml.dequantize(raw, T.Q8_0)[[32, 1]])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    head = rows.product_matrix()
    assert head.types == (Q8_0,) and torch.equal(head.matmul(x), qb.q8_0_product_reference(x, rows.data))
    assert BlockRows(int(T.Q8_0), raw[:32], 256).qtype == Q8_0X8


def test_fma32_rounds_once():
    a = torch.tensor([1 + 2 ** -23, 3.0, 1e-30], dtype=torch.float32)
    b = torch.tensor([1 - 2 ** -23, 1 / 3, 1e-10], dtype=torch.float32)
    c = torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float32)
    exact = a.double() * b.double() + c.double()
    assert torch.equal(qb.fma32(a, b, c), exact.float())  # these fp64 sums are exact
    assert qb.fma32(a, b, c)[0] != (a * b + c)[0]  # where the unfused product loses the low bits


# ------------------------------------------------------------------------------------- synthetic GGUF

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 96
LAYER_TYPES = [T.Q4_1, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.Q4_0, T.Q5_1, T.Q5_K, T.Q3_K, T.F16, T.BF16]


def write_tiny_gguf(path, layer_type, *, embed_type=T.Q8_0, v_type=T.Q6_K, seed: int = 0) -> None:
    """A 2-layer Llama GGUF: every layer matrix in `layer_type` (attn_v in `v_type` beside it, Q6_K as llama.cpp's
    mixes do), the tied embedding in `embed_type`, the norms fp32."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_vocab_size(VOCAB)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    head_dim = HIDDEN // HEADS
    rng = np.random.default_rng(seed)

    def matrix(name, n, k, qtype, s):
        raw = gguf_rows(n, k, qtype, seed=s).numpy()
        w.add_tensor(name, raw, raw_dtype=qtype)

    matrix("token_embd.weight", VOCAB, HIDDEN, embed_type, seed)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN), "attn_v": (KV_HEADS * head_dim, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}
    for i in range(LAYERS):
        for j, (part, (n, k)) in enumerate(shapes.items()):
            matrix(f"blk.{i}.{part}.weight", n, k, v_type if part == "attn_v" else layer_type, 100 * i + j + seed)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _models(path):
    """(resident-as-quantized model, the dense fp32 model of gguf's dequantized weights) of one GGUF."""
    from dspark.models import build_model
    from dspark.models.blocks import load_gguf_matrices
    from dspark.models.loader import GGUFSource
    source = GGUFSource(path)
    dense = build_model(source.config)
    ours = build_model(source.config)
    with torch.inference_mode():
        dense.load_weights(source.weights())
        load_gguf_matrices(ours, source)
    return ours, dense


@pytest.mark.parametrize("layer_type", LAYER_TYPES, ids=lambda t: t.name)
def test_every_listed_type_loads_resident_as_quantized(tmp_path, layer_type):
    from conftest import PagedKV
    from dspark.models.blocks import BF16, BlockMatrix, held_bytes
    from dspark.models.layers import LMHead, Linear, VocabEmbedding
    path = tmp_path / f"tiny-{layer_type.name}.gguf"
    write_tiny_gguf(path, layer_type)
    ours, dense = _models(path)
    kept = [n for n, m in ours.named_modules() if isinstance(m, (Linear, VocabEmbedding, LMHead)) and m.weight is not None]
    assert not kept, kept
    assert held_bytes(ours) < 0.7 * held_bytes(dense)  # no fp32 copy of a matrix (bf16 at most)
    native = layer_type in (T.Q4_1, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K)
    qkv = ours.model.layers[0].self_attn.qkv_proj.blocks
    qk = int(layer_type) if native else BF16
    if layer_type == T.Q4_K and ggml.k_group_rows() == 16:  # AVX-512 VNNI builds read Q4_K packed by 16 rows
        qk = ggml.Q4_KX16
    assert qkv.types == ((qk,) if qk == int(T.Q6_K) else (qk, int(T.Q6_K)))  # q, k stacked; v its own part
    for name, module in dense.named_modules():  # the blocks hold the dequantized model's weights
        if isinstance(module, Linear):
            mine = ours.get_submodule(name).dense_weight()
            ref = module.weight if native else module.weight.to(torch.bfloat16).float()
            assert torch.equal(mine[:HIDDEN], ref[:HIDDEN]), name
    ids = torch.tensor([0, 7, VOCAB - 1])
    assert torch.equal(ours.model.embed_tokens(ids), dense.model.embed_tokens(ids))
    seen: list[tuple[BlockMatrix, torch.Tensor, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda mod, i, o: seen.append((mod.blocks, i[0].clone(), o.clone())))
             for m in ours.modules() if isinstance(m, Linear)]
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    logits, hiddens = {}, {}
    ours._block_stack_list = False  # the per-layer modules (each product seen by the hooks), not the one-call stack
    for tag, model in (("ours", ours), ("dense", dense)):
        kv = PagedKV.create(model, num_requests=1, max_len=32, kv_block_size=4, seed=1)
        hidden = torch.cat([kv.step(model, [(prompt[:8], 0)])[0], kv.step(model, [(prompt[8:], 8)])[0]])
        logits[tag], hiddens[tag] = model.compute_logits(hidden), hidden
    for h in hooks:
        h.remove()
    assert len(seen) == 2 * 4 * LAYERS
    ours._block_stack_list = None  # the one-call stack (where its types apply): the modules' numbers bit for bit
    kv = PagedKV.create(ours, num_requests=1, max_len=32, kv_block_size=4, seed=1)
    stacked = torch.cat([kv.step(ours, [(prompt[:8], 0)])[0], kv.step(ours, [(prompt[8:], 8)])[0]])
    assert torch.equal(stacked, hiddens["ours"])
    if ggml.ops() is not None:  # the stack ran where every part has its product there
        assert (ours._block_stack_list is False) == (layer_type not in (T.Q4_1, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K))
    head = ours.lm_head.blocks  # the tied Q8_0 embedding's rows interleaved by 8, the input quantized (Q8_0 x Q8_0)
    assert head.types == (Q8_0X8,)
    assert torch.equal(logits["ours"], _part_reference(hiddens["ours"], Q8_0X8, head.parts[0][1]))
    for blocks, x, out in seen:  # every product: its parts' references on the input it got
        refs = []
        for qtype, w in blocks.parts:
            refs.append(_part_reference(x, qtype, w))
        assert torch.equal(out, torch.cat(refs, -1)), blocks.types
    err = (logits["ours"] - logits["dense"]).abs().max().item()
    assert err < 0.05 * logits["dense"].abs().max().item(), err


@pytest.mark.skipif(not kernels.has_q4_1_kernels(), reason="no Q4_1 CPU kernels")
def test_auto_keeps_the_blocks_of_a_q4_1_file_whose_head_is_not_q8_0(tmp_path):
    """`--matmul-dtype auto` on a Q4_1 GGUF: the Q4_1 load where the head is Q8_0 (the default model), the GGUF
    blocks where llama-quantize wrote a K-quant head (the Q4_1 load would hold it dense)."""
    from dspark.engine.build import resolve_matmul_dtype
    for embed_type, want in ((T.Q8_0, "q4_1"), (T.Q6_K, "gguf")):
        path = tmp_path / f"q4_1-{embed_type.name}.gguf"
        write_tiny_gguf(path, T.Q4_1, embed_type=embed_type, v_type=T.Q4_1)
        assert resolve_matmul_dtype("auto", model=str(path)) == want, embed_type.name


def test_a_layer_truncated_view_of_a_block_model_runs_its_stack(tmp_path):
    """A draft_model view of a target held as blocks (the view carries no `matmul_dtype`) takes the block stack
    or the modules by what its layers hold, never the dense stack's weights (None here): equal to its modules."""
    from conftest import PagedKV
    from dspark.drafters.draft_model import truncated_view
    path = tmp_path / "tiny-q5_0.gguf"
    write_tiny_gguf(path, T.Q5_0)
    ours, _ = _models(path)
    view = truncated_view(ours, 1)
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(2)).tolist()
    hidden = {}
    for mode in ("modules", "stack"):
        view._block_stack_list = False if mode == "modules" else None
        kv = PagedKV.create(view, num_requests=1, max_len=8, kv_block_size=4, seed=1)
        hidden[mode] = kv.step(view, [(prompt, 0)])[0]
    assert torch.equal(hidden["stack"], hidden["modules"])


def _part_reference(x, qtype, w):
    from dspark.models.blocks import BF16, F32
    if qtype == int(T.Q4_1):
        return qb.q4_1_product_reference(x, w) if kernels.has_q4_1_kernels() else qb.q4_1_linear(x, w)
    if qtype == Q8_0X8:
        return ggml.q8_0_product_reference(x, w) if ggml.ops() is not None else ggml.q8_0_block_linear(x, w)
    if qtype == int(T.Q8_0):
        return qb.q8_0_product_reference(x, w) if kernels.has_q8_0_kernels() else qb.q8_0_linear(x, w)
    if qtype == ggml.Q4_KX16:
        return ggml.product_reference(x, ggml.unpack_k16(w), int(T.Q4_K))
    if qtype in ggml.BLOCK_TYPES:
        return ggml.product_reference(x, w, qtype) if ggml.ops() is not None else ggml.block_linear(x, w, qtype)
    assert qtype in (BF16, F32)
    out = kernels.linear(x, w)
    return out if out is not None else qb.rows_product(x.to(torch.bfloat16).float(), w.float())


def test_a_tied_embedding_without_a_product_gets_a_bf16_head(tmp_path):
    from dspark.models.blocks import BF16
    path = tmp_path / "tiny-q4_0-embed.gguf"
    write_tiny_gguf(path, T.Q4_K, embed_type=T.Q4_0)
    ours, dense = _models(path)
    assert ours.lm_head.blocks.types == (BF16,)
    assert ours.model.embed_tokens.block_rows.qtype == int(T.Q4_0)
    ids = torch.arange(VOCAB)
    assert torch.equal(ours.model.embed_tokens(ids), dense.model.embed_tokens(ids))


KERNELS_OFF_CHILD = """
import json, sys, torch
from dspark.models.loader import load_model
model, cfg, tok = load_model("default", matmul_dtype=sys.argv[1])
from conftest import PagedKV
ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}])
kv = PagedKV.create(model, num_requests=1, max_len=len(ids) + 8, kv_block_size=16, seed=1)
hidden = kv.step(model, [(ids, 0)])[0]
print(json.dumps(model.compute_logits(hidden[-1:])[0].tolist()))
"""


@pytest.mark.slow
def test_the_default_model_resident_as_quantized_runs_with_the_kernels_off():
    """DSPARK_CPU_KERNELS=0: the resident Q4_1 model runs on its torch twins (blocks dequantized per product)
    and stays with the kernels' logits. Not to summation order: a last-bit difference flips an input's Q8_1
    rounding, and with AVX512-BF16 kernels the head is bf16 where the twin multiplies the Q8_0 blocks (measured
    2026-12-03: max |diff| 0.70 at max |logit| 28.8)."""
    from dspark.models.loader import resolve_model_path
    try:
        resolve_model_path("default")
    except FileNotFoundError:
        pytest.skip("the default model is not installed")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "DSPARK_CPU_KERNELS": "0", "PYTHONPATH": f"{tests.parent}:{tests}"}
    out = {}
    for mode, kernels_env in (("off", env), ("on", {**env, "DSPARK_CPU_KERNELS": "1"})):
        proc = subprocess.run([sys.executable, "-c", KERNELS_OFF_CHILD, "q4_1"], capture_output=True, text=True,
                              env=kernels_env, check=True, timeout=1800)
        out[mode] = torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert torch.isfinite(out["off"]).all()
    assert (out["off"] - out["on"]).abs().max() < 0.05 * out["on"].abs().max()


def _mapped_kib(path) -> int:
    """KiB of the file at `path` this process maps resident (/proc/self/smaps: its mappings' Rss)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5:  # a mapping's header line: its file is the last field
            inside = line.rstrip().endswith(str(path))
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps")
def test_a_tensor_copied_from_the_mapped_file_holds_at_most_a_chunk_of_its_pages(tmp_path, monkeypatch):
    """`gguf_rows`' copy drops the file's pages a chunk of rows at a time: beside the copy, the process never maps
    more than a chunk of a large tensor (an embedding copied whole, then dropped, held both at once), and none
    once it is copied; the copy equals the file's bytes."""
    from dspark.models import blocks as mb
    if not hasattr(mb._LIBC, "madvise"):
        pytest.skip("no madvise in this C library")
    path = tmp_path / "rows.bin"
    data = np.random.default_rng(0).integers(0, 256, (2048, 16384), dtype=np.uint8)  # 32 MiB of rows
    data.tofile(path)
    view = np.memmap(path, dtype=np.uint8, mode="r", shape=data.shape)
    seen, drop = [], mb.drop_mapped_pages
    monkeypatch.setattr(mb, "drop_mapped_pages", lambda v: (seen.append(_mapped_kib(path)), drop(v)))
    out = mb.copy_dropping_pages(view, chunk_bytes=4 << 20)
    assert np.array_equal(out, data) and type(out) is np.ndarray
    # a chunk, and what a fault maps around it (a large folio of the page cache: up to 2 MiB)
    assert len(seen) > 8 and max(seen) <= (4 << 10) + (2 << 10) + 256
    assert _mapped_kib(path) <= 2 << 10
