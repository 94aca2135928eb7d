"""Q4_1 products (`--matmul-dtype q4_1`): the layers multiply a Q4_1 GGUF's own blocks, the LM head its
own Q8_0 blocks where the kernels have no bf16 products.

* the packing (`kernels.pack_q4_1`: tiles of 8 rows, the GGUF's bytes reordered) and the kernel's product
  against the twin — the fp64 product of the input's Q8_1 values (`kernels.q8_1_dequantized`, checked
  against llama.cpp's quantizer as gguf implements it) with the blocks' weights (gguf's own
  dequantization) — at every row count a step uses, for odd and even block counts;
* the Q8_0 head's product against the fp64 product of the fp32 input with the blocks' values;
* a row's result is bit for bit the same alone or in any batch (prompt chunks included);
* a tiny model with Q4_1 weights: the fused decoder stack and the per-layer path against the torch twin
  (kernels off), batch invariance under four chunkings, and HF's fp32 model of the same weights;
* the real default GGUF: its packed blocks are its weights, the config checks fail before loading, and
  the shipped speculative default equals plain greedy decoding token for token in q4_1.
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from dspark import kernels
from dspark.kernels import ggml
from dspark.models.blocks import Q8_0X8
from dspark.models.config import ModelConfig
from dspark.speculation.cost_table import CostTable

from conftest import PagedKV, TINY_LLAMA, TINY_QWEN3, hf_twin

needs_q4 = pytest.mark.skipif(not kernels.has_q4_1_kernels(), reason="no Q4_1 CPU kernels (AVX2/FMA/F16C)")
Q4_1 = gguf.GGMLQuantizationType.Q4_1


def gguf_blocks(n: int, k: int, *, seed: int, kind=Q4_1) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF rows of `kind` [n, k / 32 * block bytes] uint8, their fp32 values [n, k]) of a random matrix,
    quantized by gguf's own quantizer."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    raw = gguf.quantize(w, kind)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(gguf.dequantize(raw, kind).copy())


def q4_blocks(n: int, k: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gguf_blocks(n, k, seed=seed, kind=Q4_1)


def _tile_block(rows: torch.Tensor, block: torch.Tensor) -> bool:
    """Whether 160 packed bytes are one block of 8 GGUF rows [8, 20] (d, m, 16 nibble bytes): 4 units of 8 rows
    x 4 nibble bytes, then the 8 d, then the 8 m."""
    return (torch.equal(block[:128].view(4, 8, 4), rows[:, 4:].reshape(8, 4, 4).transpose(0, 1))
            and torch.equal(block[128:144].view(8, 2), rows[:, 0:2]) and torch.equal(block[144:].view(8, 2), rows[:, 2:4]))


def test_pack_q4_1_reorders_the_gguf_bytes_into_tiles_of_8_rows():
    raw, _ = q4_blocks(16, 96, seed=1)
    packed = kernels.pack_q4_1(raw, group_rows=8)
    assert packed.shape == raw.shape and kernels.q4_1_packed_cols(packed) == 96
    assert torch.equal(packed.flatten().sort().values, raw.flatten().sort().values)  # the same bytes
    tile = packed[8:16].reshape(-1)  # the second tile: rows 8-15
    assert _tile_block(raw[8:16].view(8, 3, 20)[:, 1], tile[160:320])  # its block 1


def test_pack_q4_1_in_groups_of_16_interleaves_the_pair_of_tiles():
    """The AVX512-VNNI kernels' layout: rows 16 g .. 16 g + 15 hold, per block, unit u of the first tile then
    unit u of the second (u = 0..3, 32 bytes each), then both tiles' d, then their m; an odd last tile keeps
    the 8-row layout."""
    raw, _ = q4_blocks(40, 96, seed=1)  # 2 groups + 1 tile, 3 blocks a row
    packed = kernels.pack_q4_1(raw, group_rows=16)
    assert torch.equal(packed.flatten().sort().values, raw.flatten().sort().values)
    group = packed[16:32].reshape(3, 320)  # the second group (rows 16-31), block by block
    for b in range(3):
        for half in range(2):  # the tile's block as the 8-row layout would hold it
            units = group[b, :256].view(4, 2, 32)[:, half].reshape(128)
            d, m = group[b, 256:288].view(2, 16)[half], group[b, 288:].view(2, 16)[half]
            rows = raw[16 + 8 * half:24 + 8 * half].view(8, 3, 20)[:, b]
            assert _tile_block(rows, torch.cat([units, d, m])), (b, half)
    assert torch.equal(packed[32:], kernels.pack_q4_1(raw[32:], group_rows=8))
    with pytest.raises(ValueError, match="8 or 16"):
        kernels.pack_q4_1(raw, group_rows=32)


def test_pack_q4_1_rejects_what_it_cannot_pack():
    raw, _ = q4_blocks(12, 96, seed=1)  # 12 rows: not whole tiles of 8
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        kernels.pack_q4_1(raw)
    with pytest.raises(ValueError, match="uint8"):
        kernels.pack_q4_1(torch.zeros(8, 40, dtype=torch.int16))


def test_q8_1_dequantized_is_llama_cpps_q8_1_quantization():
    """The input's Q8_1 values: gguf's Q8_0 quantizer (llama.cpp's reference, the same e and p as Q8_1; it
    rounds halves away from zero where the kernels round to even, so ties are avoided) dequantized."""
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    x[1, :32] = 0  # an all-zero block
    x[2, 40] = 50.0  # a block with one large value
    ref = gguf.dequantize(gguf.quantize(x.numpy(), Q8_0), Q8_0)
    q8 = kernels.q8_1_dequantized(x)
    # gguf keeps e in fp16 (Q8_0); ours is fp32: the values agree to fp16 precision of e
    torch.testing.assert_close(q8, torch.from_numpy(ref.copy()), rtol=2e-3, atol=1e-6)
    assert torch.equal(q8[1, :32], torch.zeros(32))
    assert (q8 - x).abs().max() < x.abs().max() / 254 + 1e-6


@needs_q4
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 12, 13, 48, kernels.MAX_ROWS])
@pytest.mark.parametrize("k", [32, 96, 576, 1536])  # 1 block, 3, 18, 48
def test_small_mm_q4_1_matches_the_dequantized_product(rows, k):
    raw, w = q4_blocks(40, k, seed=rows + k)
    packed = kernels.pack_q4_1(raw)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    out = kernels.ops().small_mm(x, packed)
    ref = (kernels.q8_1_dequantized(x).double() @ w.double().t()).float()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    # the input really is quantized: the unquantized product is much further away than summation order
    assert (out - x @ w.t()).abs().max() > 10 * (out - ref).abs().max()


@needs_q4
def test_q4_1_row_results_do_not_depend_on_the_batch():
    """Bit for bit, a row's product is the same alone or among others, across passes, tiles, thread shares
    and the 128-row chunks of a prompt (kernels.linear)."""
    raw, _ = q4_blocks(304, 576, seed=3)
    packed = kernels.pack_q4_1(raw)
    x = torch.randn(2 * kernels.MAX_ROWS + 9, 576, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([kernels.linear(x[i:i + 1], packed) for i in range(x.shape[0])])
    for rows in (2, 4, 5, 12, 13, 61, kernels.MAX_ROWS, x.shape[0]):
        assert torch.equal(kernels.linear(x[:rows], packed), alone[:rows]), rows


@needs_q4
@pytest.mark.skipif(not getattr(kernels.ops(), "q4_1_vnni", False), reason="no AVX512-VNNI: one Q4_1 path only")
def test_q4_1_vnni_sums_are_bitwise_the_avx2_ones():
    """On a VNNI CPU the products take pairs of tiles (packed in groups of 16 rows) whose integer sums come from
    VPDPBUSD; the AVX2 path (single tiles of 8 rows, VPMADDUBSW + VPMADDWD; built beside it with
    DSPARK_Q4_NO_VNNI) computes the same exact sums and the same fp32 operations, so every product is bit for
    bit the same (odd tile counts mix both)."""
    avx2 = kernels.ops_variant("DSPARK_Q4_NO_VNNI")
    assert avx2.has_q4_1 and not avx2.q4_1_vnni and (avx2.q4_1_group_rows, kernels.ops().q4_1_group_rows) == (8, 16)
    gen = torch.Generator().manual_seed(5)
    for n, k in ((40, 96), (960, 576), (576, 1536)):
        raw = q4_blocks(n, k, seed=n + k)[0]
        packed, packed_avx2 = kernels.pack_q4_1(raw), kernels.pack_q4_1(raw, group_rows=8)
        for rows in (1, 3, 8, 13, kernels.MAX_ROWS):
            x = torch.randn(rows, k, generator=gen) * 3
            assert torch.equal(kernels.ops().small_mm(x, packed), avx2.small_mm(x, packed_avx2)), (n, k, rows)


@needs_q4
def test_small_mm_q4_1_rejects_a_mismatched_width():
    packed = kernels.pack_q4_1(q4_blocks(8, 128, seed=5)[0])
    with pytest.raises(RuntimeError, match="Q4_1"):
        kernels.ops().small_mm(torch.randn(2, 192), packed)
    with pytest.raises(RuntimeError, match="Q4_1"):  # rows in whole tiles of 8
        kernels.ops().small_mm(torch.randn(2, 128), packed[:5])


needs_q8 = pytest.mark.skipif(not kernels.has_q8_0_kernels(), reason="no Q8_0 CPU kernels (AVX2/FMA/F16C)")
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def q8_blocks(n: int, k: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gguf_blocks(n, k, seed=seed, kind=Q8_0)


def test_pack_q8_0_keeps_the_int8_weights_then_the_scales():
    raw, _ = q8_blocks(5, 96, seed=0)
    packed = kernels.pack_q8_0(raw)
    assert packed.dtype == torch.int8 and packed.shape == (5, 96 * 9 // 8)
    blocks = raw.view(5, 3, 34)
    assert torch.equal(packed[:, :96], blocks[..., 2:].contiguous().view(torch.int8).reshape(5, 96))
    assert torch.equal(packed[:, 96:].contiguous().view(torch.float32),
                       blocks[..., :2].contiguous().view(torch.float16).reshape(5, 3).float())


@needs_q8
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, kernels.MAX_ROWS])
@pytest.mark.parametrize("k", [32, 576])
def test_small_mm_q8_0_is_the_fp32_product_of_its_weights(rows, k):
    raw, w = q8_blocks(45, k, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    out = kernels.ops().small_mm(x, kernels.pack_q8_0(raw))
    torch.testing.assert_close(out, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)


@needs_q8
def test_q8_0_row_results_do_not_depend_on_the_batch():
    packed = kernels.pack_q8_0(q8_blocks(300, 576, seed=3)[0])
    x = torch.randn(kernels.MAX_ROWS + 9, 576, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([kernels.linear(x[i:i + 1], packed) for i in range(x.shape[0])])
    for rows in (2, 4, 5, 13, x.shape[0]):
        assert torch.equal(kernels.linear(x[:rows], packed), alone[:rows]), rows


# -- a tiny model with Q4_1 weights

Q4_LLAMA = replace(TINY_LLAMA, hidden_size=320, intermediate_size=512, num_attention_heads=5,
                   num_key_value_heads=1, head_dim=64)
Q4_QWEN3 = replace(TINY_QWEN3, hidden_size=320, intermediate_size=512, num_attention_heads=5,
                   num_key_value_heads=1, head_dim=64)


def q4_model(cfg: ModelConfig, *, seed: int):
    """(HF fp32 twin, ours with Q4_1 products): every layer matrix of the HF model quantized to Q4_1 (gguf's
    quantizer) and replaced by the blocks' values; ours loads those and multiplies the packed blocks
    (merged projections stacked in shard order, as the GGUF loader does)."""
    from dspark.models import build_model
    from dspark.models.layers import use_q4_1_products
    hf = hf_twin(cfg, seed=seed)
    blocks = {}
    with torch.no_grad():
        for key, t in hf.state_dict().items():
            if t.dim() == 2 and key.startswith("model.layers."):
                raw = gguf.quantize(t.numpy(), Q4_1)
                t.copy_(torch.from_numpy(gguf.dequantize(raw, Q4_1).copy()))
                blocks[key] = torch.from_numpy(np.ascontiguousarray(raw))
    ours = build_model(cfg, dtype=torch.float32, device="cpu")
    ours.load_weights(hf.state_dict().items())
    packed: dict[str, torch.Tensor] = {}
    for key, raw in blocks.items():
        name, shard = ours._resolve(key)
        module_name = name.rpartition(".")[0]
        module = ours.get_submodule(module_name)
        rows = kernels.pack_q4_1(raw)
        out = packed.setdefault(module_name, torch.zeros(module.out_features, rows.shape[1], dtype=torch.uint8))
        start, n = module.shard_rows[shard] if shard else (0, module.out_features)
        out[start:start + n] = rows
    assert use_q4_1_products(ours, packed, head_bf16=False) > 0
    return hf, ours


def _chunked_logits(model, ids, cuts):
    kv = PagedKV.create(model, num_requests=1, max_len=64, kv_block_size=4, seed=1)
    rows, start = [], 0
    for n in cuts:
        rows.append(kv.step(model, [(ids[start:start + n], start)])[0])
        start += n
    return model.compute_logits(torch.cat(rows))


@needs_q4
@pytest.mark.parametrize("cfg", [Q4_LLAMA, Q4_QWEN3], ids=["llama", "qwen3"])
def test_q4_1_model_products_match_their_twin_and_the_model_stays_hf_s(cfg, monkeypatch):
    """A prompt chunk then decode steps through the per-layer modules (the fused stack that serves such steps
    is bit for bit the same: the chunking test below): every product of the model, on the input it really got, against its twin
    (fp64 product of the input's Q8_1 values with the blocks' values); and the logits against HF's fp32
    model of the same weights — apart by the inputs' quantization only, with the same greedy tokens
    wherever HF's margin is clear. (A whole-model torch twin is no reference here: a last-bit difference
    in a norm flips an input's rounding to its Q8_1 value and moves the logits by ~1e-3.)"""
    from dspark.models.layers import Linear
    hf, ours = q4_model(cfg, seed=6)
    monkeypatch.setattr(kernels, "decoder_layers", lambda *args, **kwargs: False)  # the modules run (and are hooked)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((inp[0].clone(), out.clone(), mod.weight)))
             for m in ours.modules() if isinstance(m, Linear)]
    ids = torch.randint(3, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    logits = _chunked_logits(ours, ids, [24] + [1] * 6)
    for h in hooks:
        h.remove()
    assert len(seen) >= 4 * cfg.num_hidden_layers
    for x, out, w in seen:
        torch.testing.assert_close(out, (kernels.q8_1_dequantized(x).double() @ w.double().t()).float(),
                                   rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    err = (logits - ref).abs().max().item()
    assert 1e-5 < err < 0.05 * ref.abs().max().item(), err
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert clear.sum() >= len(ids) // 2 and torch.equal(logits.argmax(-1)[clear], ref.argmax(-1)[clear])


@needs_q4
def test_q4_1_a_token_is_bitwise_the_same_however_its_prompt_is_chunked(monkeypatch):
    """Chunks of one prompt run the fused stack (up to kernels.MAX_ROWS rows); the per-layer modules give the
    same bits."""
    _, ours = q4_model(Q4_LLAMA, seed=7)
    ids = torch.randint(3, Q4_LLAMA.vocab_size, (60,), generator=torch.Generator().manual_seed(7)).tolist()
    first = _chunked_logits(ours, ids, [60])
    for cuts in ([17, 43], [25, 5, 30], [59, 1], [3] * 20):
        assert torch.equal(_chunked_logits(ours, ids, cuts), first), cuts
    with monkeypatch.context() as m:
        m.setattr(kernels, "decoder_layers", lambda *args, **kwargs: False)
        for cuts in ([60], [17, 43]):
            assert torch.equal(_chunked_logits(ours, ids, cuts), first), ("modules", cuts)


def test_use_q4_1_products_names_an_uncovered_layer():
    from dspark.models import build_model
    from dspark.models.layers import use_q4_1_products
    with pytest.raises(ValueError, match="no Q4_1 weight for"):
        use_q4_1_products(build_model(Q4_LLAMA), {}, head_bf16=False)


# -- the real default GGUF

def test_q4_1_config_is_refused_before_loading(tmp_path):
    from dspark.config import EngineConfig
    from dspark.models.loader import load_model
    with pytest.raises(ValueError, match="matmul_dtype='q4_1' applies to dtype float32"):
        EngineConfig(matmul_dtype="q4_1", dtype="bfloat16")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(tmp_path, matmul_dtype="q4_1")


@pytest.fixture(scope="module")
def smollm2_q4(smollm2):
    from dspark.models.loader import DEFAULT_MODEL, load_model
    if not kernels.has_q4_1_kernels():
        pytest.skip("no Q4_1 CPU kernels")
    return load_model(DEFAULT_MODEL, dtype=torch.float32, matmul_dtype="q4_1")


def test_smollm2_q4_1_blocks_are_its_weights(smollm2, smollm2_q4):
    """Resident as quantized: no Linear, embedding or head keeps a dense fp32 weight, the model's tensors
    take under 1.5x the GGUF's bytes; the packed blocks hold the GGUF's weights (rows un-interleaved for
    rope like the fp32 load): each Linear's kernel product equals the fp32 model's weights times the
    input's Q8_1 values, and the embedding looks up the fp32 model's rows (bf16-rounded where the head is
    bf16, as the dense model's tied embedding was)."""
    from dspark.models.layers import LMHead, Linear, VocabEmbedding
    from dspark.models.loader import resolve_model_path
    model = smollm2_q4[0]
    dense = [n for n, m in model.named_modules() if isinstance(m, (Linear, LMHead, VocabEmbedding)) and m.weight is not None]
    assert not dense, dense[:4]
    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in [*model.buffers(), *model.parameters()]}.values()
               if t.numel() > 4096)  # the matrices (not the rope tables' nor the norms' few bytes)
    held -= sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" in n)
    assert held < 1.5 * resolve_model_path("default").stat().st_size, held
    fp32 = dict(smollm2[0].named_modules())
    ids = torch.tensor([[0, 5, 49151], [7, 7, 100]])
    ref_rows = smollm2[0].model.embed_tokens(ids)
    interleaved = ggml.ops() is not None  # the Q8_0 x Q8_0 head on the embedding's rows, interleaved by 8
    if kernels.has_bf16_kernels() and not interleaved:
        ref_rows = ref_rows.to(torch.bfloat16).float()
    assert torch.equal(model.model.embed_tokens(ids), ref_rows)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(8))
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert module.weight_q4.dtype == torch.uint8
            if checked < 8 or name.endswith("29.self_attn.qkv_proj"):
                assert torch.equal(module.dense_weight(), fp32[name].weight), name
            if checked < 8 or name.endswith("29.self_attn.qkv_proj"):
                xi = x[:, :module.in_features]
                ref = (kernels.q8_1_dequantized(xi).double() @ fp32[name].weight.double().t()).float()
                torch.testing.assert_close(kernels.linear(xi, module.weight_q4), ref, rtol=1e-5, atol=1e-4)
                checked += 1
    assert checked >= 9
    head = smollm2_q4[0].lm_head
    if interleaved:  # the tied head multiplies the embedding's own bytes, the input quantized to Q8_0
        assert head.blocks.types == (Q8_0X8,) and model.model.embed_tokens.block_rows.qtype == Q8_0X8
        assert head.blocks.parts[0][1].data_ptr() == model.model.embed_tokens.block_rows.data.data_ptr()
        h = torch.randn(4, 576, generator=torch.Generator().manual_seed(9))
        assert torch.equal(head(h), ggml.q8_0_product_reference(h, head.blocks.parts[0][1]))
    elif kernels.has_bf16_kernels():
        assert torch.equal(head.weight_bf16, smollm2[0].lm_head.weight.to(torch.bfloat16))
    elif kernels.has_q8_0_kernels():  # the GGUF's Q8_0 embedding as the head: the fp32 model's logits
        assert head.weight_q8.dtype == torch.int8
        h = torch.randn(4, 576, generator=torch.Generator().manual_seed(9))
        ref = (h.double() @ smollm2[0].lm_head.weight.double().t()).float()
        torch.testing.assert_close(head(h), ref, rtol=1e-5, atol=1e-4)


def test_smollm2_q4_1_shipped_default_greedy_equals_plain(smollm2_q4):
    """Lossless in q4_1: plain decoding of the q4_1 model against the shipped default (DSpark + lookup,
    prefix scheduler on the q4_1 cost table) under preemption and prompt chunks sharing verify steps."""
    from dspark.config import CacheConfig, EngineConfig, SchedulerConfig
    from dspark.drafters import build_drafter
    from dspark.drafters.shipped import default_spec_config
    from dspark.engine.build import build_policy
    from dspark.engine.engine import Engine
    from test_smollm2 import _generate
    model, cfg, tok = smollm2_q4
    from dspark.bench.datasets import load_prompts
    prompts = [tok.apply_chat_template([{"role": "user", "content": r.prompt}])[:400]
               for r in load_prompts("all", num_prompts=8, seed=0)]

    def engine(spec, blocks):
        config = EngineConfig(cache=CacheConfig(kv_block_size=16, num_kv_blocks=blocks), matmul_dtype="q4_1",
                              scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), spec=spec)
        if spec is None:
            return Engine(config, model=model, model_config=cfg, eos_token_ids=tok.eos_token_ids)
        drafter = build_drafter(spec, target_config=cfg, target_model=model, dtype=torch.float32, device="cpu")
        policy, cost = build_policy(config, drafter)
        assert cost.meta["matmul_dtype"] == "q4_1"
        return Engine(config, model=model, model_config=cfg, drafter=drafter, length_policy=policy,
                      cost_table=cost, eos_token_ids=tok.eos_token_ids)

    plain = _generate(engine(None, 48), prompts)
    spec = default_spec_config("SmolLM2-135M-Instruct", matmul_dtype="q4_1")
    assert spec.cost_table.endswith(f"cost_table_q4_1{'_avx512' if kernels.kernel_kind() == 'avx512' else ''}.json")
    spec_engine = engine(spec, 40)
    outs = _generate(spec_engine, prompts)
    mismatches = [i for i, (a, b) in enumerate(zip(outs, plain)) if a != b]
    assert not mismatches, f"q4_1 shipped default: prompts {mismatches} differ from q4_1 plain greedy"
    assert spec_engine.metrics.num_preemptions > 0 and spec_engine.metrics.num_accepted_tokens > 0
    assert spec_engine.block_manager.num_free_blocks == 40


@pytest.mark.parametrize("bf16", [False, True], ids=["avx2", "avx512-bf16"])
def test_auto_takes_q4_1_for_a_q4_1_gguf_where_the_kernels_have_it(smollm2, monkeypatch, tmp_path, bf16):
    """`--matmul-dtype auto`: the GGUF's own Q4_1 blocks where the kernels multiply Q4_1 and the model is a
    Q4_1 GGUF (with or without bf16 products beside them), else bf16 products where the kernels multiply
    bf16, else fp32."""
    from dspark.engine.build import resolve_matmul_dtype
    from dspark.models.loader import DEFAULT_MODEL
    monkeypatch.setattr(kernels, "has_bf16_kernels", lambda: bf16)
    monkeypatch.setattr(kernels, "has_q4_1_kernels", lambda: True)
    other = "bfloat16" if bf16 else "float32"
    assert resolve_matmul_dtype("auto", model=DEFAULT_MODEL) == "q4_1"
    assert resolve_matmul_dtype("auto", model=str(tmp_path)) == other  # not a GGUF
    assert resolve_matmul_dtype("auto", model=DEFAULT_MODEL, dtype="bfloat16") == "float32"
    assert resolve_matmul_dtype("auto", model=DEFAULT_MODEL, device="cuda") == "float32"
    # tensor parallelism: the ranks multiply slices of the dequantized weights, never the packed blocks
    assert resolve_matmul_dtype("auto", model=DEFAULT_MODEL, tensor_parallel_size=2) == other
    assert resolve_matmul_dtype("auto", model=DEFAULT_MODEL, dtype="auto", device="auto") == "q4_1"
    monkeypatch.setattr(kernels, "has_q4_1_kernels", lambda: False)
    assert resolve_matmul_dtype("auto", model=DEFAULT_MODEL) == other


def test_the_shipped_cost_table_is_the_one_of_this_kind_of_kernels(tmp_path):
    """`shipped_cost_table`: the table profiled with this machine's kind of kernels where one is shipped, else
    the dtype's own table, else none; the shipped folder has both q4_1 kinds."""
    from dspark.drafters.shipped import drafter_dir, shipped_cost_table
    (tmp_path / "cost_table_q4_1.json").write_text("{}")
    assert shipped_cost_table(tmp_path, "q4_1", kind="avx512") == tmp_path / "cost_table_q4_1.json"
    (tmp_path / "cost_table_q4_1_avx512.json").write_text("{}")
    assert shipped_cost_table(tmp_path, "q4_1", kind="avx512") == tmp_path / "cost_table_q4_1_avx512.json"
    assert shipped_cost_table(tmp_path, "q4_1", kind="avx2") == tmp_path / "cost_table_q4_1.json"
    assert shipped_cost_table(tmp_path, "bfloat16", kind="avx512") is None
    assert shipped_cost_table(tmp_path, "float16") is None
    shipped = drafter_dir("SmolLM2-135M-Instruct")
    for kind in ("avx2", "avx512"):
        table = CostTable.load(shipped_cost_table(shipped, "q4_1", kind=kind))
        assert table.meta["matmul_dtype"] == "q4_1"
        assert table.meta.get("kernels", "avx2") == kind  # the AVX2 table predates the "kernels" entry
