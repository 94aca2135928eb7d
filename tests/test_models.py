"""Our Llama/Qwen3 modules over the paged KV pool vs transformers: tiny random models (one-shot prefill,
chunked prefill + decode, taps) and the real SmolLM2-135M GGUF against transformers' own GGUF loading."""

from __future__ import annotations

import pytest
import torch

from dspark import kernels

from conftest import PagedKV, hf_twin
from dspark.models import build_model
from dspark.models.family import served_architectures
from dspark.models.layers import use_bf16_products

ATOL = 1e-4


def ours_from_hf(cfg, hf_model):
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    model.load_weights(hf_model.state_dict().items())
    return model


def kernel_model(cfg, matmul_dtype: str, *, seed: int):
    """(HF twin, ours) for a test of the CPU kernels in `matmul_dtype` products; skips where they cannot run."""
    if kernels.ops() is None:
        pytest.skip("CPU kernels unavailable")
    if matmul_dtype == "bfloat16" and not kernels.has_bf16_kernels():
        pytest.skip("no AVX512-BF16 on this CPU")
    hf = hf_twin(cfg, seed=seed)
    ours = ours_from_hf(cfg, hf)
    if matmul_dtype == "bfloat16":
        use_bf16_products(ours)
    return hf, ours


def hf_comparable_tap(model, tap: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Taps are the raw residual stream; HF's last hidden_states entry is taken after the final norm."""
    if layer_id == model.config.num_hidden_layers - 1:
        return model.model.norm(tap)
    return tap


def hf_reference(hf_model, ids: list[int]):
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


def test_registry_has_every_family():
    assert set(served_architectures()) == {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM",
                                   "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                   "Gemma4ForCausalLM"}


@pytest.mark.parametrize("kv_block_size", [4, 16])
def test_prefill_logits_and_taps_match_hf(tiny_config, kv_block_size):
    hf = hf_twin(tiny_config)
    ours = ours_from_hf(tiny_config, hf)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, tiny_config.vocab_size, (37,), generator=g).tolist()
    ref_logits, ref_hidden = hf_reference(hf, ids)
    taps_ids = (-1, 0, tiny_config.num_hidden_layers - 1, 0)
    kv = PagedKV.create(ours, num_requests=1, max_len=len(ids), kv_block_size=kv_block_size)
    hidden, taps = kv.step(ours, [(ids, 0)], tap_layer_ids=taps_ids)
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), tiny_config.vocab_size)
    err = (logits - ref_logits).abs().max().item()
    assert err < ATOL, f"prefill logits differ from HF by {err:.2e} (atol {ATOL})"
    H = tiny_config.hidden_size
    assert taps.shape == (len(ids), len(taps_ids) * H)
    for j, layer_id in enumerate(taps_ids):
        err = (hf_comparable_tap(ours, taps[:, j * H:(j + 1) * H], layer_id) - ref_hidden[layer_id + 1]).abs().max().item()
        assert err < ATOL, f"tap {layer_id} differs from HF hidden_states[{layer_id + 1}] by {err:.2e}"
    _, no_taps = kv.step(ours, [(ids[:3], 0)])
    assert no_taps is None


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_chunked_prefill_and_decode_match_one_shot(tiny_config, cpu_kernels, monkeypatch):
    if not cpu_kernels:  # the slow twin: every op through torch
        monkeypatch.setattr(kernels, "ops", lambda: None)
    elif kernels.ops() is None:
        pytest.skip("CPU kernels unavailable")
    hf = hf_twin(tiny_config, seed=3)
    ours = ours_from_hf(tiny_config, hf)
    g = torch.Generator().manual_seed(2)
    # two requests in one batch: A decodes while B is mid-prompt, so groups mix
    a = torch.randint(3, tiny_config.vocab_size, (30,), generator=g).tolist()
    b = torch.randint(3, tiny_config.vocab_size, (26,), generator=g).tolist()
    ref_a, _ = hf_reference(hf, a)
    ref_b, _ = hf_reference(hf, b)
    kv = PagedKV.create(ours, num_requests=2, max_len=32, kv_block_size=4, seed=5)
    rows_a, rows_b = [], []
    # step 1: A chunk 0..19, B chunk 0..4
    h, _ = kv.step(ours, [(a[:20], 0), (b[:5], 0)])
    rows_a.append(h[:20])
    rows_b.append(h[20:])
    # step 2: A chunk 20..26 (7 tokens), B chunk 5..22 (18 tokens: a >16 group of its own)
    h, _ = kv.step(ours, [(a[20:27], 20), (b[5:23], 5)])
    rows_a.append(h[:7])
    rows_b.append(h[7:])
    # steps 3..: one token at a time for both (decode)
    for t in range(3):
        h, _ = kv.step(ours, [(a[27 + t:28 + t], 27 + t), (b[23 + t:24 + t], 23 + t)])
        rows_a.append(h[:1])
        rows_b.append(h[1:])
    for rows, ref, name in ((rows_a, ref_a, "A"), (rows_b, ref_b, "B")):
        logits = ours.compute_logits(torch.cat(rows))
        err = (logits - ref[:logits.shape[0]]).abs().max().item()
        assert err < ATOL, f"request {name}: chunked prefill + decode logits differ by {err:.2e} (atol {ATOL})"


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_bf16_products_match_their_twin_and_stay_near_fp32(tiny_config, cpu_kernels, monkeypatch):
    """`use_bf16_products`: the kernels' bf16 products (the fused stack for one-group steps of up to 128 rows)
    against the same model computed by torch in fp64 from the rounded weights and inputs (summation order
    apart, equal), and against HF's fp32 model: further than fp32 would be (the rounding is applied) but
    with the same greedy tokens wherever fp32's margin is clear (random tiny models have near ties)."""
    if not cpu_kernels:
        monkeypatch.setattr(kernels, "ops", lambda: None)
    elif not kernels.has_bf16_kernels():
        pytest.skip("no AVX512-BF16 on this CPU")
    hf = hf_twin(tiny_config, seed=4)
    ours = ours_from_hf(tiny_config, hf)
    assert use_bf16_products(ours) > 0
    for module in ours.modules():  # weights hold their bf16 values; the copies equal them
        if hasattr(module, "weight_bf16"):
            assert torch.equal(module.weight, module.weight_bf16.float())
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, tiny_config.vocab_size, (30,), generator=g).tolist()
    kv = PagedKV.create(ours, num_requests=1, max_len=32, kv_block_size=4, seed=1)
    rows = [kv.step(ours, [(ids[:24], 0)])[0]] + [kv.step(ours, [(ids[t:t + 1], t)])[0] for t in range(24, 30)]
    logits = ours.compute_logits(torch.cat(rows))  # [30, vocab]

    from dspark.models import layers
    twin = ours_from_hf(tiny_config, hf).double()  # the bf16 model's twin: rounded weights, fp64 sums
    with torch.no_grad():
        for module in twin.modules():  # the products' weights (a tied embedding with the head)
            if isinstance(module, (layers.Linear, layers.LMHead)):
                module.weight.copy_(module.weight.bfloat16().double())
    original = layers.linear
    monkeypatch.setattr(layers, "linear", lambda x, w, b=None, *_: original(x.bfloat16().to(x.dtype), w, b))
    monkeypatch.setattr(kernels, "ops", lambda: None)
    kv64 = PagedKV.create(twin, num_requests=1, max_len=32, kv_block_size=4, seed=1, dtype=torch.float64)
    ref = twin.compute_logits(kv64.step(twin, [(ids, 0)])[0]).float()
    ref32, _ = hf_reference(hf, ids)
    err_twin, err32 = (logits - ref).abs().max().item(), (logits - ref32).abs().max().item()
    mean_twin, mean32 = (logits - ref).abs().mean().item(), (logits - ref32).abs().mean().item()
    # equal up to summation order, which may flip the bf16 rounding of an odd activation (seen: one in
    # ~10^3 logits moved by ~1e-4): bounded at the largest, ~100x below the fp32 model's distance on average
    assert err_twin < 1e-3 and mean_twin < mean32 / 100, (err_twin, mean_twin, mean32)
    assert ATOL < err32 < 0.05 * ref32.abs().max().item(), err32
    top2 = ref32.topk(2, dim=-1).values  # the same greedy token wherever fp32's margin exceeds the distance
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err32
    assert clear.sum() >= len(ids) // 2 and torch.equal(logits.argmax(-1)[clear], ref32.argmax(-1)[clear])


@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_a_token_is_bitwise_the_same_however_its_prompt_is_chunked(tiny_config, matmul_dtype):
    """Batch invariance, what greedy parity rests on: plain and speculative decoding chunk prompts
    differently (drafts take step budget) and put other requests beside them. With the CPU kernels a
    token's hidden state must not depend on that, bit for bit — with bf16 products a last-bit
    difference can flip an input's rounding and grow into a different greedy token (seen: SDPA over
    whole prompt chunks gave 9 of 210 eval prompts another output)."""
    hf, ours = kernel_model(tiny_config, matmul_dtype, seed=5)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, tiny_config.vocab_size, (60,), generator=g).tolist()
    other = torch.randint(3, tiny_config.vocab_size, (30,), generator=g).tolist()
    results = []
    for cuts in ([60], [17, 43], [25, 5, 30], [59, 1]):
        kv = PagedKV.create(ours, num_requests=2, max_len=64, kv_block_size=4, seed=7)
        kv.step(ours, [(other[:29], 0)], tap_layer_ids=())  # another request in the pool
        rows, start = [], 0
        for i, n in enumerate(cuts):  # the other request decodes beside every second chunk
            chunks = [(ids[start:start + n], start)] + ([([other[29]], 29)] if i == 1 else [])
            rows.append(kv.step(ours, chunks)[0][:n])
            start += n
        results.append(torch.cat(rows))
    for cuts, hidden in zip(([17, 43], [25, 5, 30], [59, 1]), results[1:]):
        assert torch.equal(hidden, results[0]), f"chunks {cuts}: differs by {(hidden - results[0]).abs().max():.2e}"


def test_load_weights_rejects_unknown_and_missing():
    from conftest import TINY_LLAMA
    hf = hf_twin(TINY_LLAMA)
    ours = build_model(TINY_LLAMA)
    sd = dict(hf.state_dict())
    sd["model.layers.0.self_attn.bogus.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="model.layers.0.self_attn.bogus.weight"):
        ours.load_weights(sd.items())
    del sd["model.layers.0.self_attn.bogus.weight"]
    del sd["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        ours.load_weights(sd.items())


def test_bad_tap_id_and_rope_type():
    from dataclasses import replace
    from conftest import TINY_LLAMA
    ours = build_model(TINY_LLAMA)
    kv = PagedKV.create(ours, num_requests=1, max_len=4, kv_block_size=4)
    with pytest.raises(ValueError, match="tap layer id 3"):
        kv.step(ours, [([5, 6], 0)], tap_layer_ids=(3,))
    with pytest.raises(ValueError, match="yarn"):
        build_model(replace(TINY_LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


# ------------------------------------------------------------------------------------------- SmolLM2

SMOL_ATOL = 2e-3  # fp32, 30 layers, logits of magnitude ~20: summation-order noise only


def test_smollm2_gguf_matches_transformers_gguf(smollm2, hf_smollm2):
    model, cfg, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ref_logits, ref_hidden = hf_reference(hf_smollm2, ids)
    taps_ids = (-1, 1, 15, 29)
    kv = PagedKV.create(model, num_requests=1, max_len=len(ids), kv_block_size=16)
    hidden, taps = kv.step(model, [(ids, 0)], tap_layer_ids=taps_ids)
    logits = model.compute_logits(hidden)
    err = (logits - ref_logits).abs().max().item()
    assert err < SMOL_ATOL, f"SmolLM2 logits differ from transformers by {err:.2e} (atol {SMOL_ATOL})"
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1)), "greedy tokens differ from transformers"
    H = cfg.hidden_size
    for j, layer_id in enumerate(taps_ids):
        ref = ref_hidden[layer_id + 1]
        tol = SMOL_ATOL * max(1.0, ref.abs().max().item() / 10)  # residual stream grows with depth
        err = (hf_comparable_tap(model, taps[:, j * H:(j + 1) * H], layer_id) - ref).abs().max().item()
        assert err < tol, f"SmolLM2 tap {layer_id} differs by {err:.2e} (atol {tol:.1e})"


@pytest.mark.parametrize("inference", [False, True], ids=["grad_mode", "inference_mode"])
@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_fused_decoder_layers_equal_per_layer_modules(tiny_config, matmul_dtype, inference):
    """The one-call decoder stack of steps up to kernels.MAX_ROWS rows (`kernels.decoder_layers`, the step's
    attention groups read as one padded group) against the per-layer modules on the same weights: hidden states,
    taps and every K/V written are bit-identical, for five prompts of their own groups, decode rows, verify
    windows, a two-request group, a 60-row step of five 12-token windows (more rows than one pass of the
    kernel's products serves) and a prompt chunk beside a decode row; a step past MAX_ROWS runs the modules;
    with fp32 and with bf16 matrix products. Two threads split each step's rows for the row-wise work, under
    torch.inference_mode as the engine runs it (the workers' torch ops must take the caller's mode) and without."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode(inference):
            _fused_decoder_layers_equal_per_layer_modules(tiny_config, matmul_dtype)
    finally:
        torch.set_num_threads(threads)


def _fused_decoder_layers_equal_per_layer_modules(tiny_config, matmul_dtype):
    hf, ours = kernel_model(tiny_config, matmul_dtype, seed=3)
    g = torch.Generator().manual_seed(2)
    a, b, c, d, e = (torch.randint(3, tiny_config.vocab_size, (160,), generator=g).tolist() for _ in range(5))
    steps = [[(a[:20], 0), (b[:25], 0), (c[:20], 0), (d[:20], 0), (e[:20], 0)],  # five prompt groups, 105 rows
             [(a[20:21], 20), (b[25:33], 25)],  # a decode row and an 8-token verify window
             [(a[21:30], 21), (b[33:34], 33)],
             [(a[30:31], 30), ([], 34)],  # batch 1
             [(a[31:43], 31), (b[34:46], 34), (c[20:32], 20), (d[20:32], 20), (e[20:32], 20)],  # 60 rows
             [(a[43:63], 43), (b[46:47], 46)],  # a prompt chunk beside a decode row
             [(a[63:160], 63), (b[47:80], 47)]]  # 130 rows: past MAX_ROWS, the modules
    assert sum(len(t) for t, _ in steps[-1]) > kernels.MAX_ROWS
    taps_ids = (-1, 0, tiny_config.num_hidden_layers - 1)
    runs, calls = [], []
    for fused in (True, False):
        kv = PagedKV.create(ours, num_requests=5, max_len=160, kv_block_size=4, seed=5)
        original = kernels.decoder_layers

        def spy(*args, **kw):
            ran = fused and original(*args, **kw)
            calls.append(ran)
            return ran
        kernels.decoder_layers = spy
        try:
            runs.append(([kv.step(ours, chunks, tap_layer_ids=taps_ids) for chunks in steps], kv.caches))
        finally:
            kernels.decoder_layers = original
    # fused run: the six steps of up to MAX_ROWS rows ran the kernel, the larger one never asked; module run: declined
    assert calls == [True] * 6 + [False] * 6, calls
    (fused_out, fused_kv), (module_out, module_kv) = runs
    for i, ((h1, t1), (h2, t2)) in enumerate(zip(fused_out, module_out)):
        assert torch.equal(h1, h2), f"step {i}: hidden differs by {(h1 - h2).abs().max().item():.2e}"
        assert torch.equal(t1, t2), f"step {i}: taps differ by {(t1 - t2).abs().max().item():.2e}"
    for layer, (c1, c2) in enumerate(zip(fused_kv, module_kv)):
        for name, x, y in (("K", c1[0], c2[0]), ("V", c1[1], c2[1])):
            assert torch.equal(x.nan_to_num(), y.nan_to_num()), f"layer {layer} {name} cache differs"


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_per_step_equals_a_table_of_every_position(scaling):
    """RotaryEmbedding computes cos/sin from the positions each step; the values equal, bit for bit, a table of
    every position built from the same inverse frequencies (the elementwise products and functions it holds)."""
    from dspark.models.layers import ROPE_INIT, RotaryEmbedding, rope_type
    rope = RotaryEmbedding(head_dim=64, max_positions=8192, theta=1e5, scaling=scaling, dtype=torch.float32,
                           device="cpu")
    assert not any(b.numel() > 64 for b in rope.buffers())  # no table of positions is held
    freqs = torch.outer(torch.arange(8192, dtype=torch.float32),
                        ROPE_INIT[rope_type(scaling)](64, 1e5, dict(scaling or {})))  # [8192, 32]
    cos_table = torch.cat((freqs.cos(), freqs.cos()), -1)
    sin_table = torch.cat((-freqs.sin(), freqs.sin()), -1)
    for positions in (torch.tensor([0]), torch.tensor([8191, 3, 4]), torch.arange(8192)):
        cos, sin = rope.lookup(positions)
        assert torch.equal(cos[:, 0], cos_table[positions]) and torch.equal(sin[:, 0], sin_table[positions])
    rope.to(torch.bfloat16)  # a converted module: its frequencies stay fp32, cos/sin come out in bf16
    cos, sin = rope.lookup(torch.arange(8192))
    assert rope.inv_freq.dtype == torch.float32 and cos.dtype == sin.dtype == torch.bfloat16
    assert torch.equal(cos[:, 0], cos_table.bfloat16()) and torch.equal(sin[:, 0], sin_table.bfloat16())
