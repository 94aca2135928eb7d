"""Block manager invariants: allocation, ref counts, hash-chain prefix hits over committed blocks only,
draft-KV-aware hits, and a pool that is entirely free once every request has ended."""

import random

from dspark.engine.block_manager import BlockManager
from dspark.request import Request
from dspark.sampling import SamplingParams


def _req(rid, ids):
    return Request(rid, list(ids), SamplingParams())


def test_allocate_free_and_refcounts():
    bm = BlockManager(num_kv_blocks=8, kv_block_size=4)
    a = _req("a", range(10))
    assert bm.allocate(a, 10) and len(a.block_table) == 3
    assert bm.allocate(a, 12) and len(a.block_table) == 3  # already covered
    b = _req("b", range(20))
    assert not bm.allocate(b, 24)  # 6 blocks > 5 free: refused, nothing taken
    assert b.block_table == [] and bm.num_free_blocks == 5
    bm.free_request(a)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_hit_only_over_committed_full_blocks():
    bm = BlockManager(num_kv_blocks=16, kv_block_size=4)
    a = _req("a", range(11))
    bm.allocate(a, 11)
    a.num_computed_tokens = 6  # only block 0 is full and committed
    bm.commit(a)
    b = _req("b", range(11))
    assert bm.match_prefix(b, need_draft_kv=False) == 4
    assert b.block_table == a.block_table[:1]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    a.num_computed_tokens = 11
    bm.commit(a)
    c = _req("c", range(11))
    # 11 tokens: 2 full blocks committed, and one token must be left to compute
    assert bm.match_prefix(c, need_draft_kv=False) == 8
    d = _req("d", list(range(8)))  # exactly two blocks: the last token must be recomputed
    assert bm.match_prefix(d, need_draft_kv=False) == 4
    e = _req("e", [99] + list(range(1, 11)))  # first block differs: the chain breaks at once
    assert bm.match_prefix(e, need_draft_kv=False) == 0
    for r in (a, b, c, d, e):
        bm.free_request(r)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_kv_blocks=4, kv_block_size=4)
    a = _req("a", range(9))
    bm.allocate(a, 9)
    a.num_computed_tokens = 8
    bm.commit(a)
    bm.free_request(a)
    b = _req("b", range(9))
    assert bm.match_prefix(b, need_draft_kv=False) == 8  # hit after the owner ended
    bm.free_request(b)
    # a request that needs the whole pool evicts the cached content
    c = _req("c", [50 + i for i in range(16)])
    assert bm.allocate(c, 16)
    bm.free_request(c)
    d = _req("d", range(9))
    assert bm.match_prefix(d, need_draft_kv=False) == 0
    bm.check_invariants()


def test_draft_hit_requires_drafter_kv():
    bm = BlockManager(num_kv_blocks=8, kv_block_size=4)
    a = _req("a", range(13))
    bm.allocate(a, 13)
    a.num_computed_tokens = 12
    a.num_draft_computed = 4  # drafter context only over the first block
    bm.commit(a)
    b = _req("b", range(13))
    assert bm.match_prefix(b, need_draft_kv=True) == 4  # target hit is 12, draft hit 4
    c = _req("c", range(13))
    assert bm.match_prefix(c, need_draft_kv=False) == 12


def test_blocks_with_drafter_kv_replace_cached_ones_without():
    """A prefix first computed by a request without drafter context (cached without drafter K/V), then
    by one with it: the hashes move to the blocks that carry both, so later requests with a drafter
    context hit them, and requests without one still do; the old blocks are plain free blocks again."""
    bm = BlockManager(num_kv_blocks=16, kv_block_size=4)
    a = _req("a", range(13))
    bm.allocate(a, 13)
    a.num_computed_tokens = 12  # no drafter context
    bm.commit(a)
    old = list(a.block_table[:3])
    b = _req("b", range(13))
    assert bm.match_prefix(b, need_draft_kv=True) == 0  # a target hit, not a draft hit
    bm.allocate(b, 13)
    b.num_computed_tokens = 12
    bm.commit(b)  # target K/V first, drafter context a step later
    assert bm.match_prefix(_req("x", range(13)), need_draft_kv=True) == 0
    bm.free_request(_req("x", range(13)))
    b.num_draft_computed = 8
    bm.commit(b)
    bm.free_request(a)
    c = _req("c", range(13))
    assert bm.match_prefix(c, need_draft_kv=True) == 8 and c.block_table == b.block_table[:2]
    d = _req("d", range(13))
    assert bm.match_prefix(d, need_draft_kv=False) == 12
    assert d.block_table == b.block_table[:2] + old[2:]  # the third block: still a's, the only one cached
    assert all(bm.blocks[i].block_hash is None for i in old[:2])
    bm.check_invariants()
    for r in (b, c, d):
        bm.free_request(r)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    bm = BlockManager(num_kv_blocks=32, kv_block_size=4)
    live = []
    for step in range(400):
        if live and rng.random() < 0.4:
            r = live.pop(rng.randrange(len(live)))
            bm.free_request(r)
        else:
            ids = [rng.randrange(3) for _ in range(rng.randrange(2, 30))]
            r = _req(f"r{step}", ids)
            cached = bm.match_prefix(r, need_draft_kv=False)
            if bm.allocate(r, len(ids)):
                r.num_computed_tokens = len(ids) - 1
                bm.commit(r)
                live.append(r)
            else:
                bm.free_request(r)
            assert cached <= len(ids) - 1
        bm.check_invariants()
    for r in live:
        bm.free_request(r)
    assert bm.num_free_blocks == 32
    bm.check_invariants()
