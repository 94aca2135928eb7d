"""The DSpark drafter's one-call kernels (dspark/drafters/dspark_fused.py, dspark/kernels/cpu_ops_draft.inc) against
the per-op path they stand in for:

* the greedy proposal in one call (`fused_proposal`: block forward, final norm, LM head, vanilla Markov walk,
  confidence head) drafts what the proposal op by op drafts, the confidences bit for bit, with fp32 and Q4_1
  products, a reduced vocabulary, W1's rows held as bf16 and `anchor_features`, and over several calls where one
  call takes fewer requests than the batch;
* the gated and RNN heads, top-K drafting, sampled drafting and a bf16 LM head keep the per-op path (the kernel is
  never called) and draft what they drafted;
* the context extension in one call (`fused_context_kv`) stores the per-op path's values: keys within the RoPE's
  rounding (one fused multiply-add instead of three roundings), values exactly; bf16 products keep the per-op path;
* the blocks' inputs built in one call (`kernels.draft_inputs`) equal the general attention-metadata builder's
  indices, the embeddings' rows and the model's RoPE.

    pytest tests/test_fused_proposal.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark import kernels
from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch
from dspark.drafters.dspark import build, save_dspark
from dspark.sampling import SamplingParams
from tests.dspark_helpers import (TAPS, TARGET, make_pool, propose_request, random_model, random_target, spec,
                                  tiny_cfg)

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels unavailable")
NUM_REQS = 5


def _built(tmp_path, dtype: str, **cfg_kw):
    """A random drafter (Q4_1-compatible widths) built as an engine builds it, with `draft_matmul_dtype` `dtype`."""
    cfg = dataclasses.replace(tiny_cfg(enable_confidence_head=True, **cfg_kw), intermediate_size=64)
    model = random_model(cfg, seed=2)
    if cfg.draft_vocab_size:
        model.reset_buffers(d2t=torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))
                            [:cfg.draft_vocab_size])
    save_dspark(model, cfg, tmp_path / "d", dtype="bfloat16")  # W1 then held as bf16 rows (`hold_rows_bf16`)
    drafter = build(spec(tmp_path / "d", draft_matmul_dtype=dtype), target_config=TARGET, target_model=random_target(),
                    dtype=torch.float32, device="cpu")
    make_pool(drafter, num_blocks=40, kv_block_size=4)
    return drafter


def _context(drafter, seed: int = 5) -> tuple[list[list[int]], list[list[int]]]:
    """Extend NUM_REQS requests' contexts by 3 .. 7 positions → (their ids, block tables)."""
    g = torch.Generator().manual_seed(seed)
    lens = [3 + i for i in range(NUM_REQS)]
    ids = [torch.randint(3, 120, (12,), generator=g).tolist() for _ in lens]
    tables = [[4 * i + j + 1 for j in range(4)] for i in range(NUM_REQS)]
    starts = [sum(lens[:i]) for i in range(NUM_REQS)]
    taps = torch.randn(sum(lens), len(TAPS) * TARGET.hidden_size, generator=g)
    drafter.extend_context(ContextUpdate([ContextSegment(f"r{i}", tables[i], 0, ids[i][:n], None,
                                                         slice(starts[i], starts[i] + n)) for i, n in enumerate(lens)],
                                         taps))
    return ids, tables


def _batch(ids, tables, method: str = "greedy", params=None) -> ProposeBatch:
    reqs = [propose_request(f"r{i}", ids[i], 3 + i, tables[i], *(params(i) if params else ()))
            for i in range(NUM_REQS)]
    return ProposeBatch(reqs, 4, method)


def _both(drafter, batch, monkeypatch):
    """(the proposal as served, the proposal op by op, how many one-call kernel calls the first made)."""
    calls = []
    original = kernels.draft_block
    monkeypatch.setattr(kernels, "draft_block", lambda *a, **k: calls.append(1) or original(*a, **k))
    served = drafter.propose(batch)
    monkeypatch.setattr(drafter, "_fused_proposal", lambda batch: None)
    per_op = drafter.propose(batch)
    monkeypatch.undo()
    return served, per_op, len(calls)


@pytest.mark.parametrize("dtype,anchor", [("float32", False), ("q4_1", False), ("bfloat16", False), ("float32", True)])
@pytest.mark.parametrize("draft_vocab_size", [None, 48])
def test_the_greedy_proposal_in_one_call_equals_the_per_op_path(tmp_path, monkeypatch, dtype, anchor,
                                                                 draft_vocab_size):
    """The backbone's products in any dtype the fused stack takes; the LM head the target's fp32 rows (full
    vocabulary) or the drafter's copy (reduced): Q4_1 blocks or fp32 take the one call, a bf16 copy (its product
    path depends on the row count) keeps the per-op path."""
    if dtype == "q4_1" and not kernels.has_q4_1_kernels():
        pytest.skip("no Q4_1 products on this CPU")
    if dtype == "bfloat16" and not (kernels.has_bf16_kernels() or kernels.has_bf16w_kernels()):
        pytest.skip("no bf16 products on this CPU")
    drafter = _built(tmp_path, dtype, draft_vocab_size=draft_vocab_size, anchor_features=anchor)
    assert drafter.model.markov_head.markov_w1.weight.dtype == torch.bfloat16  # the served layout of W1
    batch = _batch(*_context(drafter))
    served, per_op, calls = _both(drafter, batch, monkeypatch)
    head_copy = draft_vocab_size is not None and dtype != "float32"  # else an fp32 head: the kernel up to MAX_ROWS rows
    assert calls == (0 if head_copy and dtype == "bfloat16" else 1), "the one-call proposal did not run"
    assert torch.equal(served.draft_ids, per_op.draft_ids)
    assert torch.equal(served.confidence, per_op.confidence)
    assert served.draft_probs is None and per_op.draft_probs is None
    ids = torch.tensor([5, 9, 5, 77, 9])  # the frozen model's kept anchor rows are the embedding's rows
    assert torch.equal(drafter.model.anchor_rows(ids), drafter.model.embed_tokens(ids).float())
    assert set(drafter.model._row_cache) >= {5, 9, 77}
    with monkeypatch.context() as m:  # two requests a call: three calls of whole blocks, the same drafts (an fp32
        m.setattr(kernels, "MAX_ROWS", 2 * drafter.cfg.block_size)  # head past MAX_ROWS rows: torch's, per op)
        split, _, calls = _both(drafter, batch, m)
    assert calls == (3 if head_copy and dtype == "q4_1" else 0) and torch.equal(split.draft_ids, per_op.draft_ids)
    torch.testing.assert_close(split.confidence, per_op.confidence, rtol=0, atol=1e-6)
    # the one call is no stand-in that repeats the per-op path's answer: other weights, other drafts
    head = drafter.model.markov_head.markov_w2.weight
    head.mul_(-1)
    flipped, flipped_per_op, _ = _both(drafter, batch, monkeypatch)
    head.mul_(-1)
    assert torch.equal(flipped.draft_ids, flipped_per_op.draft_ids)
    assert not torch.equal(flipped.draft_ids, served.draft_ids)


@pytest.mark.parametrize("case", ["gated", "rnn", "topk", "sampled"])
def test_other_heads_and_modes_keep_the_per_op_path(tmp_path, monkeypatch, case):
    head_type = case if case in ("gated", "rnn") else "vanilla"
    drafter = _built(tmp_path, "float32", markov_head_type=head_type)
    drafter.draft_topk = 4 if case == "topk" else 0
    ids, tables = _context(drafter)
    sampled = lambda i: (SamplingParams(temperature=0.8), torch.Generator().manual_seed(i))  # noqa: E731
    batch = _batch(ids, tables, "probabilistic", sampled) if case == "sampled" else _batch(ids, tables)
    if case == "sampled":
        served = drafter.propose(batch)
        calls = []
        original = kernels.draft_block
        monkeypatch.setattr(kernels, "draft_block", lambda *a, **k: calls.append(1) or original(*a, **k))
        again = drafter.propose(_batch(ids, tables, "probabilistic", sampled))
        assert not calls and torch.equal(served.draft_ids, again.draft_ids)
        return
    served, per_op, calls = _both(drafter, batch, monkeypatch)
    assert calls == 0
    assert torch.equal(served.draft_ids, per_op.draft_ids) and torch.equal(served.confidence, per_op.confidence)


@pytest.mark.parametrize("dtype", ["float32", "q4_1", "bfloat16"])
def test_the_context_extension_in_one_call_stores_the_per_op_values(tmp_path, monkeypatch, dtype):
    if dtype == "q4_1" and not kernels.has_q4_1_kernels():
        pytest.skip("no Q4_1 products on this CPU")
    if dtype == "bfloat16" and not (kernels.has_bf16_kernels() or kernels.has_bf16w_kernels()):
        pytest.skip("no bf16 products on this CPU")
    drafter = _built(tmp_path, dtype)
    calls = []
    original = kernels.draft_context
    monkeypatch.setattr(kernels, "draft_context", lambda *a, **k: calls.append(1) or original(*a, **k))
    _context(drafter)
    served = [(k.clone(), v.clone()) for k, v in drafter.kv_caches]
    assert len(calls) == (0 if dtype == "bfloat16" else 1)
    monkeypatch.setattr(drafter.model, "fused_context_kv", lambda *a, **k: None)
    make_pool(drafter, num_blocks=40, kv_block_size=4)
    _context(drafter)
    written = ~torch.isnan(served[0][0])
    for (k, v), (k_ref, v_ref) in zip(served, drafter.kv_caches):
        assert torch.equal(torch.isnan(k), torch.isnan(k_ref)), "the same slots written"
        torch.testing.assert_close(k[written], k_ref[written], rtol=0, atol=2e-6)
        assert torch.equal(v[written], v_ref[written])
    # every context position's slot (and slot 0, which the pool zeroes as gather padding)
    assert written.flatten(0, 1).all(-1).all(-1).sum() == sum(3 + i for i in range(NUM_REQS)) + 1


def test_the_blocks_inputs_equal_the_general_builders():
    """`kernels.draft_inputs` (the rows, RoPE and attention indices of the draft blocks, in one call) gives
    `build_attn_metadata`'s slots, rows and key limits for the same non-causal blocks (contexts of different lengths:
    padded key rows), the rows the embeddings (plus anchor features) make, and `DSparkModel.rope`'s cos / sin with
    the rotate-half sign folded in (within the cosine's rounding)."""
    from dspark.drafters.dspark_model import rope_inv_freq
    from dspark.models.attention import SeqSpec, build_attn_metadata

    g = torch.Generator().manual_seed(3)
    size, bs, hidden, head_dim = 7, 16, 32, 64
    starts = [37, 5, 70]
    tables = [torch.randperm(64, generator=g)[:-(-(s + size) // bs) + i].tolist() for i, s in enumerate(starts)]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    anchors, mask, add = torch.randn(3, hidden, generator=g), torch.randn(hidden, generator=g), torch.randn(3, hidden, generator=g)
    inv_freq = rope_inv_freq(head_dim, 10000.0, None)
    x, cos, sin, slots, token_index, key_limit, kv_slots = kernels.draft_inputs(
        anchors, mask, add, torch.tensor(starts), padded, bs, inv_freq, size)
    seqs = [SeqSpec(block_table=t, num_cached=s, num_query=size, token_offset=i * size, causal=False)
            for i, (t, s) in enumerate(zip(tables, starts))]
    meta = build_attn_metadata(seqs, num_tokens=3 * size, kv_block_size=bs)
    group = meta.groups[0]
    assert torch.equal(slots, meta.slot_mapping) and torch.equal(token_index, group.token_index)
    assert torch.equal(key_limit, group.key_limit) and torch.equal(kv_slots, group.kv_slots)
    rows = torch.cat([anchors.unsqueeze(1), mask.expand(3, size - 1, hidden)], 1) + add.unsqueeze(1)
    assert torch.equal(x, rows.reshape(-1, hidden))
    positions = (torch.tensor(starts).unsqueeze(1) + torch.arange(size)).reshape(-1).float()
    emb = torch.cat([positions.unsqueeze(-1) * inv_freq] * 2, -1)  # DSparkModel.rope's angles
    torch.testing.assert_close(cos, emb.cos(), rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, torch.cat([-emb[:, :32].sin(), emb[:, 32:].sin()], -1), rtol=0, atol=2e-6)


def test_a_context_window_reads_only_the_last_positions_on_both_paths(tmp_path, monkeypatch):
    """`draft_context_window` (the drafter's attention over the last N context positions): the one-call proposal
    drafts what the per-op path drafts with the same window, the confidences bit for bit; a window that covers
    every context drafts what no window does, bit for bit; a window that cuts the contexts changes the drafts (it
    is no stand-in)."""
    drafter = _built(tmp_path, "float32")
    batch = _batch(*_context(drafter, seed=9))  # contexts of 3 .. 7 positions
    whole, _, _ = _both(drafter, batch, monkeypatch)
    drafter.context_window = 16  # past every context: nothing cut
    wide, wide_per_op, calls = _both(drafter, batch, monkeypatch)
    assert calls == 1 and torch.equal(wide.draft_ids, whole.draft_ids) and torch.equal(wide.confidence, whole.confidence)
    assert torch.equal(wide_per_op.draft_ids, whole.draft_ids)
    drafter.context_window = 2
    cut, cut_per_op, calls = _both(drafter, batch, monkeypatch)
    assert calls == 1
    assert torch.equal(cut.draft_ids, cut_per_op.draft_ids) and torch.equal(cut.confidence, cut_per_op.confidence)
    assert not torch.equal(cut.confidence, whole.confidence)


def test_the_context_window_setting(tmp_path):
    from dspark.config import SpecConfig
    from dspark.drafters.dspark import context_window
    (tmp_path / "train_config.json").write_text('{"max_seq_len": 640}')
    assert context_window(SpecConfig(method="dspark", model=str(tmp_path))) == 640  # "auto": the trained length
    assert context_window(SpecConfig(method="dspark", model=str(tmp_path), draft_context_window=0)) is None
    assert context_window(SpecConfig(method="dspark", model=str(tmp_path), draft_context_window=256)) == 256
    (tmp_path / "train_config.json").unlink()
    assert context_window(SpecConfig(method="dspark", model=str(tmp_path))) is None  # not recorded: the whole context
    for bad in (-1, "all", True, 1.5):
        with pytest.raises(ValueError, match="draft_context_window"):
            SpecConfig(method="dspark", model=str(tmp_path), draft_context_window=bad)
    with pytest.raises(ValueError, match="draft_context_window applies"):
        SpecConfig(method="ngram", draft_context_window=64)
