"""paged_attention over a shuffled paged KV pool equals dense SDPA per request over contiguous K/V:
several requests with different cached lengths and query lengths (decode, verify-sized, a >16-token
chunk), GQA, and a non-causal block; the same step's groups read as one padded group give the same rows."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from dspark.models.attention import (SeqSpec, build_attn_metadata, one_group_metadata, paged_attention,
                                     sliding_window_metadata, store_kv)

ATOL = 1e-5


def dense_reference(q, k, v, *, num_cached: int, causal: bool, scale: float) -> torch.Tensor:
    """q [nq, H, hd], k/v [num_cached + nq, Hkv, hd] contiguous -> [nq, H, hd]."""
    nq, nk = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        mask = torch.arange(nk).unsqueeze(0) <= torch.arange(nq).unsqueeze(1) + num_cached
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("kv_block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_paged_matches_dense(kv_block_size, heads):
    num_heads, num_kv_heads = heads
    head_dim, scale = 16, 16 ** -0.5
    g = torch.Generator().manual_seed(kv_block_size * 10 + num_kv_heads)
    # (num_cached, num_query, causal)
    reqs = [(0, 1, True), (9, 1, True), (37, 5, True), (0, 23, True), (12, 20, True), (5, 8, False),
            (3, 16, True), (0, 17, False)]
    per_req = [-(-(c + n) // kv_block_size) for c, n, _ in reqs]
    num_blocks = sum(per_req) + 4
    ids = list(range(num_blocks))
    random.Random(7).shuffle(ids)
    tables, start = [], 0
    for n in per_req:
        tables.append(ids[start:start + n])
        start += n
    k_cache = torch.randn(num_blocks, kv_block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, kv_block_size, num_kv_heads, head_dim, generator=g)
    # per request: the full contiguous K/V (cached part written to the pool now, new part via store_kv)
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=g) for c, n, _ in reqs]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=g) for c, n, _ in reqs]
    seqs, offset = [], 0
    for r, (c, n, causal) in enumerate(reqs):
        for p in range(c):
            b, o = tables[r][p // kv_block_size], p % kv_block_size
            k_cache[b, o], v_cache[b, o] = full_k[r][p], full_v[r][p]
        seqs.append(SeqSpec(block_table=tables[r], num_cached=c, num_query=n, token_offset=offset,
                            causal=causal))
        offset += n
    q = torch.randn(offset, num_heads, head_dim, generator=g)
    new_k = torch.cat([full_k[r][c:] for r, (c, _, _) in enumerate(reqs)])
    new_v = torch.cat([full_v[r][c:] for r, (c, _, _) in enumerate(reqs)])
    meta = build_attn_metadata(seqs, num_tokens=offset, kv_block_size=kv_block_size)
    assert len(meta.groups) == 4, "three >16-token chunks get their own groups, the rest share one"
    store_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(q, k_cache, v_cache, meta, scale=scale)
    for r, (c, n, causal) in enumerate(reqs):
        s = seqs[r]
        ref = dense_reference(q[s.token_offset:s.token_offset + n], full_k[r], full_v[r], num_cached=c,
                              causal=causal, scale=scale)
        err = (out[s.token_offset:s.token_offset + n] - ref).abs().max().item()
        assert err < ATOL, f"request {r} (cached {c}, query {n}, causal {causal}): max err {err:.2e} > {ATOL}"
    # as one padded group (the one-call decoder stacks' view): every row the same, bit for bit on the CPU
    # kernel (each query computed on its own) and within SDPA's rounding on the torch path (padded shapes)
    merged = one_group_metadata(meta)
    assert len(merged.groups) == 1 and one_group_metadata(merged) is merged and one_group_metadata(meta) is merged
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, merged, scale=scale), out, rtol=0, atol=ATOL)
    from dspark import kernels
    if kernels.ops() is not None:
        assert torch.equal(paged_attention(q, k_cache, v_cache, merged, scale=scale), out)
    causal = build_attn_metadata([SeqSpec(block_table=tables[3], num_cached=0, num_query=20, token_offset=0),
                                  SeqSpec(block_table=tables[1], num_cached=9, num_query=1, token_offset=20)],
                                 num_tokens=21, kv_block_size=kv_block_size)
    with pytest.raises(ValueError, match="windowed"):  # a sliding window's groups are merged by their own metadata
        one_group_metadata(sliding_window_metadata(causal, 4, trim=False))


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    store_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 1, 2)[[0, 5]].eq(1).all() and v_cache.view(-1, 1, 2)[[0, 5]].eq(2).all()
    assert k_cache.sum() == 4, "slot -1 must not be written"


def test_reduced_precision_grouped_query_path_matches_sdpa():
    """bf16 takes the grouped-query matmul path (fp32 softmax); it must equal fp32 SDPA within bf16
    rounding (2^-8 relative on O(1) outputs → 0.05 absolute)."""
    import torch.nn.functional as F
    from dspark.models.attention import _attend
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 5, 16, generator=g)
    k = torch.randn(3, 2, 21, 16, generator=g)
    v = torch.randn(3, 2, 21, 16, generator=g)
    mask = torch.rand(3, 1, 5, 21, generator=g) > 0.3
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    out = _attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.25).float()
    assert (out - ref).abs().max() < 0.05
    out_nomask = _attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 0.25).float()
    ref_nomask = F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    assert (out_nomask - ref_nomask).abs().max() < 0.05

