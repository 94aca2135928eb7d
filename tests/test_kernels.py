"""The CPU kernels (dspark/kernels/cpu_ops.cpp) against their torch twins: few-row products, RMSNorm with
and without the fused residual add, and short-query paged attention (causal, block-bidirectional, GQA,
padding). The model-level twin (kernels off vs HF) is in test_models.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark import kernels

ops = kernels.ops()
pytestmark = pytest.mark.skipif(ops is None, reason="CPU kernels unavailable (DSPARK_CPU_KERNELS=0 or no compiler)")


@pytest.mark.parametrize("rows", [*range(1, 14), 16, 25, 48, 49, 97, kernels.MAX_ROWS])
@pytest.mark.parametrize("k,n", [(576, 131), (37, 9), (64, 1)])
def test_small_mm_matches_matmul(rows, k, n):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    out = ops.small_mm(x, w)
    ref = (x.double() @ w.double().t()).float()
    assert out.shape == (rows, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_small_mm_row_results_do_not_depend_on_the_batch():
    """Bit for bit, a row's product is the same alone or among up to MAX_ROWS rows, across the pass split
    and the weight tiles (n = 300 output rows over K = 576: three tiles): a request's logits never depend
    on what else is in its step."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(kernels.MAX_ROWS, 576, generator=g), torch.randn(300, 576, generator=g)
    alone = torch.cat([ops.small_mm(x[i:i + 1], w) for i in range(x.shape[0])])
    for rows in (2, 12, 13, 48, 61, kernels.MAX_ROWS):
        assert torch.equal(ops.small_mm(x[:rows], w), alone[:rows]), rows


needs_bf16 = pytest.mark.skipif(not kernels.has_bf16_kernels(), reason="no AVX512-BF16 on this CPU")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 7, 12, 13, 16, 48, 97, kernels.MAX_ROWS])
@pytest.mark.parametrize("k,n", [(576, 131), (37, 9), (64, 1), (96, 40)])
def test_small_mm_bf16_matches_rounded_matmul(rows, k, n):
    """bf16 weights: the input rounded to bf16, exact products, fp32 sums — the twin is the fp32 product of
    the rounded values (only the summation order differs), and it is not the unrounded product."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    wb = w.bfloat16()
    out = ops.small_mm(x, wb)
    ref = (x.bfloat16().double() @ wb.double().t()).float()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    if k >= 64:  # the rounding is really applied: the fp32 product is further away than summation order
        assert (out - x @ w.t()).abs().max() > 10 * (out - ref).abs().max()


@needs_bf16
def test_small_mm_bf16_row_results_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(kernels.MAX_ROWS, 1536, generator=g), torch.randn(200, 1536, generator=g).bfloat16()
    alone = torch.cat([ops.small_mm(x[i:i + 1], w) for i in range(x.shape[0])])
    for rows in (2, 12, 13, 48, 61, kernels.MAX_ROWS):
        assert torch.equal(ops.small_mm(x[:rows], w), alone[:rows]), rows


@needs_bf16
def test_linear_bf16_above_max_rows_runs_the_kernel_in_chunks():
    """Prompt chunks (more rows than one kernel call serves) multiply bf16 weights in MAX_ROWS-row chunks:
    every row's result is the one it gets alone (a decode step's), and close to the rounded product."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(2 * kernels.MAX_ROWS + 37, 576, generator=g), torch.randn(100, 576, generator=g).bfloat16()
    out = kernels.linear(x.view(1, *x.shape), w)[0]
    alone = torch.cat([kernels.linear(x[i:i + 1], w) for i in range(x.shape[0])])
    assert torch.equal(out, alone)
    torch.testing.assert_close(out, (x.bfloat16().double() @ w.double().t()).float(), rtol=1e-5, atol=1e-4)


needs_bf16w = pytest.mark.skipif(not kernels.has_bf16w_kernels(), reason="bf16 weights are widened only on AVX2 builds")


@needs_bf16w
@pytest.mark.parametrize("rows", [1, 2, 7, 12, 13, 48, 97, kernels.MAX_ROWS])
@pytest.mark.parametrize("k,n", [(576, 131), (37, 9), (64, 1), (1536, 40)])
def test_small_mm_widened_bf16_is_the_fp32_kernel_on_the_same_values(rows, k, n):
    """AVX2 (BF16W): bf16 weights times the unrounded fp32 input is bit for bit the fp32 kernel's product
    of the widened weights (same sums in the same order; K tails included), close to the fp64 product,
    and not the product of a bf16-rounded input."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, wb = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
    out = ops.small_mm(x, wb)
    assert torch.equal(out, ops.small_mm(x, wb.float()))
    torch.testing.assert_close(out, (x.double() @ wb.double().t()).float(), rtol=1e-5, atol=1e-4)
    if k >= 64:
        rounded = (x.bfloat16().double() @ wb.double().t()).float()
        assert (out - rounded).abs().max() > 10 * (out - (x.double() @ wb.double().t()).float()).abs().max()


@needs_bf16w
def test_linear_fp32_input_routes_bf16_weights_to_the_widening_path():
    g = torch.Generator().manual_seed(3)
    x, wb = torch.randn(2, 3, 96, generator=g), torch.randn(40, 96, generator=g).bfloat16()
    assert kernels.linear(x, wb) is None  # without fp32_input bf16 weights mean rounded input: not here
    out = kernels.linear(x, wb, fp32_input=True)
    assert out.shape == (2, 3, 40) and torch.equal(out, kernels.linear(x, wb.float()))


def test_small_mm_above_max_rows_is_its_chunks_in_one_output():
    """More than MAX_ROWS rows: chunks of MAX_ROWS rows from the first, each row's result bit for bit the one
    its chunk gets alone (fp32 and bf16 weights)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2 * kernels.MAX_ROWS + 21, 96, generator=g)
    for w in (torch.randn(40, 96, generator=g), torch.randn(40, 96, generator=g).bfloat16()):
        if w.dtype == torch.bfloat16 and not (kernels.has_bf16_kernels() or kernels.has_bf16w_kernels()):
            continue
        chunks = torch.cat([ops.small_mm(part, w) for part in x.split(kernels.MAX_ROWS)])
        assert torch.equal(ops.small_mm(x, w), chunks)


def test_small_mm_rejects_bad_input():
    with pytest.raises(RuntimeError, match="row"):
        ops.small_mm(torch.randn(0, 4), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="fp32"):
        ops.small_mm(torch.randn(1, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))


def test_linear_routes_only_eligible_products():
    w = torch.randn(5, 8)
    assert kernels.linear(torch.randn(3, 8), w) is not None
    assert kernels.linear(torch.randn(kernels.MAX_ROWS + 1, 8), w) is None  # too many rows: torch
    assert kernels.linear(torch.randn(2, 8, dtype=torch.bfloat16), w.bfloat16()) is None
    assert kernels.linear(torch.randn(2, 8, requires_grad=True), w) is None  # autograd: torch
    # bf16 weights with fp32 input: the kernel where the CPU has bf16 dot products
    assert (kernels.linear(torch.randn(3, 8), w.bfloat16()) is not None) == kernels.has_bf16_kernels()


def test_rms_norm_and_fused_add():
    g = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(5, 576, generator=g), torch.randn(5, 576, generator=g),
               torch.randn(576, generator=g))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    expect_r = r + x
    residual = r.clone()
    normed = ops.add_rms_norm_(x, residual, w, 1e-5)
    torch.testing.assert_close(residual, expect_r)
    torch.testing.assert_close(normed, F.rms_norm(expect_r, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [1, 7, 16, 49152, 262144])
def test_row_argmax_is_torch_max(vocab):
    """Values and first indices equal torch.max(x, -1)'s: ties (first wins), +-0, a NaN (the first NaN), +inf,
    a row of -inf, a row of -inf but one entry, and plain random rows."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1] = float("-inf")
    x[2] = float("-inf")
    x[2, vocab - 1] = -3.0
    x[3, vocab // 2] = float("inf")
    x[4, vocab // 3] = float("nan")
    x[4, vocab - 1] = float("nan")
    x[5] = 0.0
    x[5, vocab // 2] = -0.0
    x[6, vocab // 4] = x[6, vocab - 1] = 1e9  # a tie: the first
    x[7, vocab // 5] = float("inf")
    x[7, vocab - 1] = float("nan")
    values, indices = kernels.row_argmax(x)
    ref = x.max(dim=-1)
    assert torch.equal(indices, ref.indices)
    assert torch.equal(values.isnan(), ref.values.isnan())
    same = ~ref.values.isnan()
    assert torch.equal(values[same], ref.values[same])
    assert torch.equal(torch.signbit(values[same]), torch.signbit(ref.values[same]))


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("w1_dtype", [torch.float32, torch.bfloat16])
def test_markov_walk_is_the_step_loop(rows, w1_dtype):
    """The greedy vanilla Markov walk in one call drafts what the loop does position by position: the bias
    W2 · W1[prev] (small_mm, W1's rows widened from bf16), the first argmax of base + bias (a tie, and a
    NaN row: its first NaN), then prev = d2t[draft]."""
    g = torch.Generator().manual_seed(rows)
    vocab, target_vocab, rank, gamma = 300, 1000, 16, 7
    base = torch.randn(rows, gamma, vocab, generator=g)
    base[0, 2, 5] = base[0, 2, 9] = 1e4  # a tie: the first index
    base[-1, 4, 17] = float("nan")
    w1 = torch.randn(target_vocab, rank, generator=g).to(w1_dtype)
    w2 = torch.randn(vocab, rank, generator=g)
    d2t = torch.randperm(target_vocab, generator=g)[:vocab]
    anchor = torch.randint(0, target_vocab, (rows,), generator=g)
    prev, expect = anchor, []
    for k in range(gamma):
        logits = base[:, k] + ops.small_mm(w1[prev].float(), w2)
        prev = d2t[logits.max(dim=-1).indices]
        expect.append(prev)
    assert torch.equal(kernels.markov_walk(base, w1, w2, d2t, anchor), torch.stack(expect, dim=1))
    assert kernels.markov_walk(base.requires_grad_(), w1, w2, d2t, anchor) is None  # autograd: the caller's loop
    with pytest.raises(RuntimeError, match="outside W1"):
        ops.markov_walk(base.detach(), w1[:10], w2, d2t, anchor % 10 + 10)


def test_short_attention_matches_reference():
    """Three requests of 1, 4 (causal) and 3 (bidirectional block) queries over scattered pool slots,
    H=6 query heads on 2 KV heads, padding rows left untouched."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, hd, num_slots = 6, 2, 16, 64
    q = torch.randn(8, heads, hd, generator=g)
    k_flat, v_flat = torch.randn(num_slots, kv_heads, hd, generator=g), torch.randn(num_slots, kv_heads, hd, generator=g)
    token_index = torch.tensor([[0, 0, 0, 0], [1, 2, 3, 4], [5, 6, 7, 0]])
    key_limit = torch.tensor([[9, 0, 0, 0], [3, 4, 5, 6], [12, 12, 12, 0]])
    kv_slots = torch.randperm(num_slots, generator=g)[:36].view(3, 12)
    out = torch.full_like(q, 7.0)
    ref = out.clone()
    ops.short_attention(q, k_flat, v_flat, token_index, key_limit, kv_slots, out, 0.25)
    kernels.short_attention_reference(q, k_flat, v_flat, token_index, key_limit, kv_slots, ref, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the reference itself against SDPA for the causal request
    keys = k_flat[kv_slots[1, :6]].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)  # [H, 6, hd]
    vals = v_flat[kv_slots[1, :6]].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    mask = torch.arange(6)[None, :] < key_limit[1][:, None]  # [4, 6]
    sdpa = F.scaled_dot_product_attention(q[1:5].transpose(0, 1), keys, vals, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(ref[1:5], sdpa.transpose(0, 1), rtol=1e-5, atol=1e-5)


def _attention_case(seed: int, heads: int, kv_heads: int, hd: int, windows: list[tuple[int, int]]):
    """Requests of (queries, keys) over scattered pool slots, causal, with one padded query row per request
    beyond the first: q, k_flat, v_flat, token_index, key_limit, kv_slots."""
    g = torch.Generator().manual_seed(seed)
    max_q, max_kv = max(n for n, _ in windows) + 1, max(kv for _, kv in windows)
    num_slots = sum(kv for _, kv in windows) + 5
    perm = torch.randperm(num_slots, generator=g)
    token_index = torch.zeros(len(windows), max_q, dtype=torch.long)
    key_limit = torch.zeros(len(windows), max_q, dtype=torch.long)
    kv_slots = torch.zeros(len(windows), max_kv, dtype=torch.long)
    rows = slot = 0
    for i, (n, kv) in enumerate(windows):
        token_index[i, :n] = torch.arange(rows, rows + n)
        key_limit[i, :n] = torch.arange(kv - n + 1, kv + 1)  # causal: the last query sees every key
        kv_slots[i, :kv] = perm[slot:slot + kv]
        rows, slot = rows + n, slot + kv
    q = torch.randn(rows, heads, hd, generator=g)
    k_flat = torch.randn(num_slots, kv_heads, hd, generator=g)
    v_flat = torch.randn(num_slots, kv_heads, hd, generator=g)
    return q, k_flat, v_flat, token_index, key_limit, kv_slots


@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (8, 2, 128), (6, 2, 16), (4, 4, 64), (8, 2, 8)])
def test_short_attention_tiles_give_each_query_its_untiled_result(heads, kv_heads, hd):
    """Query heads reading the same keys run in tiles that share key and value loads; bit for bit a query's
    result is the one it gets alone (tile 1), whatever the tile size: a prompt chunk, a verification window at
    a long context, decode rows of many requests, keys past whole 16-key blocks; and it matches the torch twin."""
    windows = [(1, 1), (7, 40), (1, 300), (33, 33), (8, 129), (3, 17)]
    q, k_flat, v_flat, token_index, key_limit, kv_slots = _attention_case(heads * hd, heads, kv_heads, hd, windows)

    def run(tile: int) -> torch.Tensor:
        out = torch.full_like(q, 7.0)
        before = ops.set_attention_tile(tile)
        try:
            ops.short_attention(q, k_flat, v_flat, token_index, key_limit, kv_slots, out, hd ** -0.5)
        finally:
            ops.set_attention_tile(before)
        return out

    alone = run(1)
    for tile in (2, 3, 5, 24, 32):
        assert torch.equal(run(tile), alone), tile
    ref = torch.full_like(q, 7.0)
    kernels.short_attention_reference(q, k_flat, v_flat, token_index, key_limit, kv_slots, ref, hd ** -0.5)
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="set_attention_tile"):
        ops.set_attention_tile(0)


def test_add_rms_norm_is_in_place_only_outside_autograd():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    residual = torch.randn(3, 64, generator=g, requires_grad=True)
    before = residual.detach().clone()
    total, normed = kernels.add_rms_norm(x, residual, w, 1e-5)  # autograd: the torch twin
    assert total is not residual and torch.equal(residual.detach(), before)
    normed.sum().backward()
    assert residual.grad is not None
    with torch.no_grad():
        plain = before.clone()
        total, normed = kernels.add_rms_norm(x, plain, w, 1e-5)  # the kernel, in place
    assert total is plain
    torch.testing.assert_close(plain, before + x)
    torch.testing.assert_close(normed, F.rms_norm(before + x, (64,), w, 1e-5), rtol=1e-5, atol=1e-5)


@needs_bf16w
def test_decoder_layers_widened_bf16_is_the_fp32_stack_on_the_same_values():
    """The one-call decoder stack with bf16 matrices on AVX2 (BF16W: the fp32 input times the widened
    weights) is bit for bit the stack on the widened fp32 copies: hidden rows and every K/V stored, for a
    causal verify window and a block-bidirectional draft block of two requests."""
    from dspark.models.attention import SeqSpec, build_attn_metadata
    g = torch.Generator().manual_seed(11)
    D, H, Hkv, hd, inter, layers, bs = 128, 4, 2, 32, 192, 2, 4

    def weights(bf16: bool) -> list[torch.Tensor]:
        gw = torch.Generator().manual_seed(12)
        out = []
        for _ in range(layers):
            mats = [torch.randn(n, k, generator=gw) * 0.1 for n, k in
                    (((H + 2 * Hkv) * hd, D), (D, H * hd), (2 * inter, D), (D, inter))]
            mats = [m.bfloat16() if bf16 else m.bfloat16().float() for m in mats]
            out += [torch.rand(D, generator=gw) + 0.5, mats[0], torch.rand(hd, generator=gw) + 0.5,
                    torch.rand(hd, generator=gw) + 0.5, mats[1], torch.rand(D, generator=gw) + 0.5, mats[2], mats[3]]
        return out

    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    seqs = [SeqSpec(tables[0], 9, 7, 0, causal=False), SeqSpec(tables[1], 3, 7, 7, causal=True)]
    meta = build_attn_metadata(seqs, num_tokens=14, kv_block_size=bs)
    grp = meta.groups[0]
    x0 = torch.randn(14, D, generator=g)
    angles = torch.rand(14, hd, generator=g)
    cos, sin = angles.cos(), angles.sin()
    caches0 = [torch.randn(8, bs, Hkv, hd, generator=g) for _ in range(2 * layers)]
    results = []
    for bf16 in (True, False):
        x, caches = x0.clone(), [c.clone() for c in caches0]
        assert kernels.decoder_layers(x, weights(bf16), caches[:layers], caches[layers:], cos, sin, meta.slot_mapping,
                                      grp.token_index, grp.key_limit, grp.kv_slots, num_heads=H, num_kv_heads=Hkv,
                                      eps=1e-5, scale=hd ** -0.5)
        results.append((x, caches))
    (xb, cb), (xf, cf) = results
    assert not torch.equal(xb, x0) and torch.equal(xb, xf)
    assert all(torch.equal(a, b) for a, b in zip(cb, cf))


def test_finished_build_loads_without_torchs_extension_loader():
    """A fresh process loads the stamped build as it is: the same module file and functions, and neither
    torch.utils.cpp_extension nor setuptools imported."""
    import json
    import subprocess
    import sys
    from dspark.kernels import compiled
    assert (compiled.build_dir() / "dspark_cpu_ops.stamp").is_file()
    code = ("import json, sys, torch\nfrom dspark.kernels import compiled\nk = compiled.ops()\n"
            "print(json.dumps([k.__file__, sorted(n for n in dir(k) if not n.startswith('_')),"
            " [m for m in ('torch.utils.cpp_extension', 'setuptools') if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    file, names, imported = json.loads(out.splitlines()[-1])
    assert file == ops.__file__ and names == sorted(n for n in dir(ops) if not n.startswith("_"))
    assert imported == []


def test_build_without_a_matching_stamp_goes_through_torchs_loader(tmp_path, monkeypatch):
    """No stamp (a build stopped part way, or one from before stamps) or a stamp of other flags: torch's
    loader builds, and the finished build is stamped; a matching stamp and the .so: imported as they are."""
    import torch.utils.cpp_extension
    from dspark.kernels import compiled
    loads, imports = [], []

    def load(name, build_directory, extra_cflags, **kw):
        loads.append(extra_cflags)
        (tmp_path / f"{name}.so").write_bytes(b"")
        return "built"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(compiled, "_import_built", lambda name, so: imports.append((name, so)) or "imported")
    stamp = tmp_path / "dspark_test.stamp"
    assert compiled.build("dspark_test", tmp_path) == "built" and stamp.is_file()
    assert compiled.build("dspark_test", tmp_path) == "imported"
    assert imports == [("dspark_test", tmp_path / "dspark_test.so")] and len(loads) == 1
    stamp.unlink()
    assert compiled.build("dspark_test", tmp_path) == "built" and stamp.is_file()
    assert compiled.build("dspark_test", tmp_path, defines=("DSPARK_X",)) == "built"
    assert loads[-1][-1] == "-DDSPARK_X" and len(loads) == 3 and len(imports) == 1
    assert (tmp_path / "src" / compiled.SOURCE.name).is_file()  # the build compiled the staged copy
