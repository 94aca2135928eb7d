"""Top-K Markov drafting (spec "draft_topk", dspark/drafters/dspark.py + heads.py): each draft position's K
best base logits are its candidates and the sequential head corrects only those rows.

* every head's `step(candidates=)` equals the full step's values at the candidates;
* K covering the draft vocabulary reproduces the full head: the same greedy drafts and confidences, the same
  proposal distribution when sampling (same seeds);
* with a small K sampled proposals put no mass outside the candidates and still sum to one;
* greedy speculative output equals plain greedy output with any K;
* bad values are refused with the key's name;
* the greedy walk of the vanilla head in one kernel call (`kernels.markov_walk`) drafts what the per-position
  loop drafts, with W1's rows fp32 or held as bf16.

    pytest tests/test_draft_topk.py -q
"""

from __future__ import annotations

import pytest
import torch

from dspark.config import SpecConfig
from dspark.drafters.base import ContextSegment, ContextUpdate, ProposeBatch
from dspark.drafters.dspark import DSparkDrafter, save_dspark
from dspark import kernels
from dspark.drafters.heads import SEQUENTIAL_HEADS
from dspark.sampling import SamplingParams
from tests.dspark_helpers import greedy_engine_run
from tests.test_dspark_drafter import (TAPS, TARGET, make_pool, propose_request, random_model, random_target,
                                       tiny_cfg)


@pytest.mark.parametrize("head_type", list(SEQUENTIAL_HEADS))
def test_head_step_on_candidates_equals_full_step(head_type):
    cfg = tiny_cfg(markov_head_type=head_type)
    head = random_model(cfg).markov_head
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, cfg.vocab_size, generator=g)
    hidden = torch.randn(4, cfg.hidden_size, generator=g)
    prev = torch.randint(0, cfg.vocab_size, (4,), generator=g)
    cand = torch.stack([torch.randperm(cfg.vocab_size, generator=g)[:5] for _ in range(4)])  # [4, 5]
    with torch.no_grad():
        state = head.init_state(num_rows=4, device="cpu", dtype=torch.float32)
        full, s_full = head.step(base_logits=base, hidden=hidden, prev_ids=prev, state=state)
        part, s_part = head.step(base_logits=base.gather(1, cand), hidden=hidden, prev_ids=prev, state=state,
                                 candidates=cand)
    torch.testing.assert_close(part, full.gather(1, cand), atol=1e-5, rtol=1e-5)
    if s_full is not None:
        torch.testing.assert_close(s_part, s_full)


def _drafter(cfg, topk: int, seed: int = 1) -> DSparkDrafter:
    model = random_model(cfg, seed=seed)
    if cfg.draft_vocab_size:
        model.reset_buffers(d2t=torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(4))
                            [:cfg.draft_vocab_size])
    drafter = DSparkDrafter(model, num_draft_tokens=cfg.block_size, draft_topk=topk)
    make_pool(drafter, num_blocks=16, kv_block_size=4)
    return drafter


def _propose(drafter: DSparkDrafter, method: str):
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, 120, (9,), generator=g).tolist() for _ in range(3)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    taps = torch.randn(24, len(TAPS) * TARGET.hidden_size, generator=g)
    drafter.extend_context(ContextUpdate([ContextSegment(f"r{i}", tables[i], 0, ids[i][:8], None,
                                                         slice(8 * i, 8 * i + 8)) for i in range(3)], taps))
    sampled = SamplingParams(temperature=0.9, top_p=0.95)
    reqs = [propose_request("r0", ids[0], 8, tables[0]),  # greedy
            propose_request("r1", ids[1], 8, tables[1], sampled, torch.Generator().manual_seed(7)),
            propose_request("r2", ids[2], 8, tables[2], SamplingParams(temperature=1.3),
                            torch.Generator().manual_seed(8))]
    if method == "greedy":
        reqs = [propose_request(f"r{i}", ids[i], 8, tables[i]) for i in range(3)]
    return drafter.propose(ProposeBatch(reqs, 4, method))


@pytest.mark.parametrize("head_type", list(SEQUENTIAL_HEADS))
@pytest.mark.parametrize("draft_vocab_size", [None, 48])
def test_topk_covering_the_draft_vocabulary_equals_the_full_head(head_type, draft_vocab_size):
    cfg = tiny_cfg(markov_head_type=head_type, enable_confidence_head=True, draft_vocab_size=draft_vocab_size)
    vocab = cfg.effective_draft_vocab_size
    for method in ("greedy", "probabilistic"):
        full, topk = _propose(_drafter(cfg, 0), method), _propose(_drafter(cfg, vocab), method)
        assert torch.equal(full.draft_ids, topk.draft_ids), method
        torch.testing.assert_close(topk.confidence, full.confidence, atol=1e-6, rtol=1e-5)
        if method == "probabilistic":
            torch.testing.assert_close(topk.draft_probs, full.draft_probs, atol=1e-5, rtol=1e-4)


def test_small_k_proposal_distribution_stays_on_the_candidates():
    cfg = tiny_cfg(enable_confidence_head=True, draft_vocab_size=48)
    drafter = _drafter(cfg, 3)
    proposal = _propose(drafter, "probabilistic")
    probs = proposal.draft_probs  # [3, γ, vocab]
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2]), atol=1e-5, rtol=0)
    assert ((probs > 0).sum(-1) <= 3).all(), "mass outside the K candidates"
    assert all(probs[i, k, proposal.draft_ids[i, k]] > 0 for i in range(3) for k in range(cfg.block_size))
    # K=1: the head cannot change a single candidate, so greedy drafts are the base logits' argmax
    one = _drafter(cfg, 1)
    greedy = _propose(one, "greedy")
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, 120, (9,), generator=g).tolist() for _ in range(3)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    base, _, _ = one.forward_blocks(ProposeBatch([propose_request(f"r{i}", ids[i], 8, tables[i]) for i in range(3)],
                                                 4, "greedy"))
    assert torch.equal(greedy.draft_ids, one.model.d2t[base.argmax(-1)])


@pytest.mark.parametrize("topk", [1, 3, 128])
def test_engine_greedy_parity_with_any_k(tmp_path, topk):
    target = random_target(seed=7)
    cfg = tiny_cfg(enable_confidence_head=True)
    save_dspark(random_model(cfg, seed=3), cfg, tmp_path / "d", dtype="float32")
    plain, _ = greedy_engine_run(target, None)
    spec_config = SpecConfig(method="dspark", model=str(tmp_path / "d"), num_speculative_tokens=4,
                             draft_topk=topk)
    spec_out, engine = greedy_engine_run(target, spec_config)
    assert spec_out == plain
    assert engine.drafter.draft_topk == topk and engine.metrics.verify_lens, "the drafter never proposed"


def test_draft_topk_validation(tmp_path):
    with pytest.raises(ValueError, match="draft_topk must be >= 0"):
        SpecConfig(method="dspark", model="x", draft_topk=-1)
    with pytest.raises(ValueError, match="draft_topk applies to method 'dspark'"):
        SpecConfig(method="dflash", model="x", draft_topk=8)
    cfg = tiny_cfg(markov_rank=0, enable_confidence_head=False)
    save_dspark(random_model(cfg), cfg, tmp_path / "d", dtype="float32")
    from dspark.drafters.dspark import check
    with pytest.raises(ValueError, match="markov_rank"):
        check(SpecConfig(method="dspark", model=str(tmp_path / "d"), num_speculative_tokens=4, draft_topk=4), TARGET)


@pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("draft_vocab_size", [None, 48])
@pytest.mark.parametrize("rows_bf16", [False, True])
def test_greedy_walk_in_one_kernel_call_equals_the_loop(monkeypatch, draft_vocab_size, rows_bf16):
    cfg = tiny_cfg(enable_confidence_head=True, draft_vocab_size=draft_vocab_size)
    kernel, loop = _drafter(cfg, 0), _drafter(cfg, 0)
    for d in (kernel, loop):
        if rows_bf16:  # the served layout of a bf16 checkpoint: W1 held as bf16, its rows read back as fp32
            w1 = d.model.markov_head.markov_w1.weight
            w1.data = w1.data.to(torch.bfloat16).float()
            assert d.model.markov_head.hold_rows_bf16() > 0
    calls = []
    walk = kernels.markov_walk
    monkeypatch.setattr(kernels, "markov_walk", lambda *a: calls.append(1) or walk(*a))
    monkeypatch.setattr(loop, "_walks_in_kernel", lambda head: False)
    monkeypatch.setattr(kernel, "_fused_proposal", lambda batch: None)  # the walk called from Python (per op)
    fast, slow = _propose(kernel, "greedy"), _propose(loop, "greedy")
    assert calls == [1], "the kernel walk did not run"
    assert torch.equal(fast.draft_ids, slow.draft_ids)
    assert torch.equal(fast.confidence, slow.confidence)
