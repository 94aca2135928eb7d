"""Prefix caching on hybrid linear-attention targets (tiny random Qwen3.5 / Qwen3-Next configs of tests/test_hybrid.py):
a second request sharing a prefix resumes from the recurrent-state snapshot at the deepest cached block boundary and
gets the logits of a cold run (bit for bit on the dense hybrids with the CPU kernels, 1e-6 otherwise: the MoE
blocks' products depend on the rows routed together), with and without speculation (prompt lookup, the
checkpoint's MTP layer), with a rejection right after the cached boundary, under preemption and after eviction
(the snapshot gone: the cold path); greedy output equals plain decoding without the cache; the branch point of two
prompts becomes a snapshot for a third; no state slot, pending snapshot or held snapshot is left when requests end;
snapshots written by the chunked and the one-token recurrence hold the state a step ending there keeps; the block
manager's bookkeeping (which boundaries, one owner, least recently used reuse); the /metrics series; and
a failing twin (restoring another boundary's snapshot) that the logits check catches."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from dspark import kernels
from dspark.config import CacheConfig, SpecConfig
from dspark.engine.block_manager import BlockManager, block_hash
from dspark.models.recurrent import LayerState
from dspark.request import Request
from dspark.sampling import SamplingParams
from tests.engine_helpers import greedy, make_engine, ngram_engine_args, run, tiny_target
from tests.test_hybrid import CONFIGS, ScriptedDrafter, _ids

PREFIX = _ids(32, 50)  # 8 blocks of 4 tokens; snapshots every 16 tokens: at 16 and 32
FIRST, SECOND = PREFIX + _ids(9, 51), PREFIX + _ids(11, 52)


@pytest.fixture(scope="module", params=list(CONFIGS))
def target(request):
    cfg = CONFIGS[request.param]
    return tiny_target(cfg)[0], cfg


def _engine(model, cfg, **kw):
    args = dict(budget=64, state_snapshot_interval=16) | kw
    return make_engine(model, cfg, **args)


class LogitsRecorder:
    """Wraps an engine's runner: every logits row it computes, by request, with the tokens up to its position."""

    def __init__(self, engine):
        self.rows: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = defaultdict(list)
        runner, self._sched = engine.runner, None
        prepare, forward = runner.prepare, runner.forward

        def recording_prepare(sched, **kw):
            self._sched = sched
            return prepare(sched, **kw)

        def recording_forward(batch, **kw):
            logits, taps = forward(batch, **kw)
            for item, offset in zip(self._sched.scheduled, batch.logits_offsets):
                req = item.request
                ids = req.all_ids[:item.start_pos + item.num_new_tokens - item.num_drafts] + item.draft_ids
                first = item.start_pos + item.num_new_tokens - item.num_logits
                for j in range(item.num_logits):
                    self.rows[req.request_id].append((tuple(ids[:first + j + 1]), logits[offset + j].clone()))
            return logits, taps

        runner.prepare, runner.forward = recording_prepare, recording_forward

    def committed(self, request_id: str, tokens: list[int]) -> dict[int, torch.Tensor]:
        """position -> logits row, over the rows whose tokens up to their position are the request's (rejected
        drafts and what follows them left out)."""
        return {len(ids) - 1: row for ids, row in self.rows[request_id] if tuple(tokens[:len(ids)]) == ids}


def _generate(engine, prompt: list[int], max_tokens: int = 12) -> tuple[str, list[int]]:
    rid = engine.add_request(prompt, greedy(max_tokens))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return rid, out


def _logits_match(cfg, warm: dict[int, torch.Tensor], cold: dict[int, torch.Tensor]) -> float | None:
    """None when the logits agree at every position (bit for bit on a dense hybrid with the CPU kernels, within 1e-6
    otherwise), else the largest difference."""
    assert sorted(warm) == sorted(cold) and warm
    diff = max((warm[p] - cold[p]).abs().max().item() for p in cold)
    exact = not cfg.num_experts and kernels.ops() is not None
    ok = all(torch.equal(warm[p], cold[p]) for p in cold) if exact else diff <= 1e-6
    return None if ok else diff


def _assert_released(engine) -> None:
    """Every request ended: no state slot, no KV block, no snapshot being written, none held by a request."""
    bm = engine.block_manager
    assert bm.num_used_state_slots == 0 and bm.num_free_blocks == len(bm.blocks)
    assert not any(bm.pending_snapshots.values()) and not bm.branch_points
    assert all(bm.blocks[bm.hash_to_block[h]].ref_count == 0 for h in bm.snapshots)
    bm.check_invariants()


def _warm_and_cold(model, cfg, prompt=SECOND, max_tokens=12, first=FIRST, **kw):
    """(the warm engine, its request id, output, logits) after `first` ran there, and (output, logits) of `prompt`
    alone in a fresh engine of the same configuration."""
    cold = _engine(model, cfg, **kw)
    cold_rec = LogitsRecorder(cold)
    cold_id, cold_out = _generate(cold, prompt, max_tokens)
    warm = _engine(model, cfg, **kw)
    warm_rec = LogitsRecorder(warm)
    _generate(warm, first, max_tokens)
    rid, out = _generate(warm, prompt, max_tokens)
    return (warm, out, warm_rec.committed(rid, prompt + out)), (cold_out, cold_rec.committed(cold_id, prompt + cold_out))


@pytest.mark.parametrize("drafter", ["plain", "ngram"])
def test_a_prefix_hit_gives_the_cold_logits(target, drafter):
    model, cfg = target
    kw = ngram_engine_args() if drafter == "ngram" else {}
    (warm, out, logits), (cold_out, cold_logits) = _warm_and_cold(model, cfg, **kw)
    bm = warm.block_manager
    assert warm.scheduler.num_prefix_cache_hits == 32 and bm.num_snapshot_hits == 1
    assert _logits_match(cfg, logits, cold_logits) is None
    assert out == cold_out == run(make_engine(model, cfg, prefix=False), [SECOND], greedy(12))[0]
    if drafter == "ngram":
        assert warm.metrics.num_draft_tokens > 0
    assert bm.num_snapshots_stored == 3 + 1  # the first prompt: 16, 32 and its last full block (40); the second: 40
    _assert_released(warm)


def test_restoring_another_boundarys_snapshot_is_caught(target, monkeypatch):
    """The failing twin: a hit that starts from the snapshot of another boundary (16 instead of 32) gives logits
    the check refuses."""
    model, cfg = target
    start = LayerState.start

    def wrong_boundary(self, slot, pos, source=-1):
        if source < 0:
            return start(self, slot, pos)
        other = self.snap_positions.index(15)
        return self.snap_conv[other].clone(), self.snap_recurrent[other].clone()

    monkeypatch.setattr(LayerState, "start", wrong_boundary)
    (warm, _, logits), (_, cold_logits) = _warm_and_cold(model, cfg)
    assert warm.block_manager.num_snapshot_hits == 1
    assert _logits_match(cfg, logits, cold_logits) > 1e-3


def test_mtp_speculation_resumes_from_a_snapshot(tmp_path):
    """The checkpoint's MTP layer drafting on a hit (its context K/V cached with the blocks): cold logits, plain
    output."""
    from safetensors.torch import load_file, save_file
    from dspark.config import EngineConfig, SchedulerConfig
    from dspark.engine.build import build_engine
    from tests.test_hybrid import _copy_tokenizer
    from tests.test_hybrid_drafters import _mtp_tensors
    cfg = CONFIGS["qwen3_5"]
    _, hf = tiny_target(cfg)
    hf.save_pretrained(tmp_path)
    _copy_tokenizer(tmp_path)
    save_file({**load_file(tmp_path / "model.safetensors"), **_mtp_tensors(cfg)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})

    def engine(spec, prefix=True):
        return build_engine(EngineConfig(model=str(tmp_path), spec=spec, cache=CacheConfig(
            kv_block_size=4, num_kv_blocks=128, enable_prefix_caching=prefix, state_snapshot_interval=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, coalesce_steps=0)))[0]
    spec = SpecConfig(method="mtp", num_speculative_tokens=3)
    plain = run(engine(None, prefix=False), [SECOND], greedy(12))[0]
    cold = engine(spec)
    cold_rec = LogitsRecorder(cold)
    cold_id, cold_out = _generate(cold, SECOND)
    warm = engine(spec)
    warm_rec = LogitsRecorder(warm)
    _generate(warm, FIRST)
    rid, out = _generate(warm, SECOND)
    assert warm.block_manager.num_snapshot_hits == 1 and warm.metrics.num_draft_tokens > 0
    assert out == cold_out == plain
    assert _logits_match(cfg, warm_rec.committed(rid, SECOND + out), cold_rec.committed(cold_id, SECOND + out)) is None
    _assert_released(warm)


def test_a_rejection_right_after_the_cached_boundary(target):
    """The second prompt is the cached prefix and one token: its first step computes that token from the snapshot,
    its first verification window rejects its first draft, and the next rejects inside the window (rollback into the
    ring written after the snapshot)."""
    model, cfg = target
    prompt = PREFIX + [7]
    refs = [p + o for p, o in zip([FIRST, prompt], run(make_engine(model, cfg, prefix=False), [FIRST, prompt],
                                                        greedy(12)))]

    def scripted():
        return {"drafter": ScriptedDrafter(refs), "spec": SpecConfig(method="ngram", num_speculative_tokens=4)}
    cold = _engine(model, cfg, **scripted())
    cold_rec = LogitsRecorder(cold)
    cold_id, cold_out = _generate(cold, prompt)
    warm = _engine(model, cfg, **scripted())
    warm_rec = LogitsRecorder(warm)
    _generate(warm, FIRST)
    warm.drafter.rounds = 0  # the same drafts as the cold run: round 0 rejects draft 0, round 1 draft 1 ...
    rid, out = _generate(warm, prompt)
    assert warm.scheduler.num_prefix_cache_hits == 32 and warm.block_manager.num_snapshot_hits == 1
    assert out == cold_out == refs[1][len(prompt):]
    assert 0 < warm.metrics.num_accepted_tokens < warm.metrics.num_draft_tokens
    assert _logits_match(cfg, warm_rec.committed(rid, prompt + out), cold_rec.committed(cold_id, prompt + out)) is None
    _assert_released(warm)


def _shared_prompts(n: int) -> list[list[int]]:
    return [PREFIX + _ids(5 + 3 * i, 60 + i) for i in range(n)]


@pytest.mark.parametrize("drafter", ["plain", "ngram"])
def test_preemption_with_prefix_hits_equals_plain(target, drafter):
    """Requests sharing the prefix in a pool too small for them all: preempted ones come back through a hit on
    their own or their neighbours' blocks; greedy output equals plain decoding without the cache."""
    model, cfg = target
    prompts = _shared_prompts(6)
    plain = run(make_engine(model, cfg, prefix=False), prompts, greedy(16))
    kw = ngram_engine_args() if drafter == "ngram" else {}
    engine = _engine(model, cfg, budget=40, num_kv_blocks=32, max_num_seqs=4, **kw)
    assert run(engine, prompts[:1], greedy(16)) == plain[:1]  # the prefix and its snapshots are cached
    assert run(engine, prompts, greedy(16)) == plain
    bm = engine.block_manager
    assert engine.metrics.num_preemptions > 0 and bm.num_snapshot_hits > 1
    _assert_released(engine)


@pytest.mark.parametrize("evicted", ["kv_blocks", "snapshots"])
def test_after_eviction_the_cold_path_is_taken(target, evicted):
    """The first prompt's snapshots go (its blocks reused by other prompts, or their entries taken by newer
    snapshots while its blocks stay cached): the second request takes the cold path, with the cold logits."""
    model, cfg = target
    others = [_ids(40, 70 + i) for i in range(3)]
    kw = {"num_kv_blocks": 24} if evicted == "kv_blocks" else {"max_state_snapshots": 3}
    cold = _engine(model, cfg, **kw)
    cold_rec = LogitsRecorder(cold)
    cold_id, cold_out = _generate(cold, SECOND)
    warm = _engine(model, cfg, **kw)
    warm_rec = LogitsRecorder(warm)
    _generate(warm, FIRST)
    bm = warm.block_manager
    stored = bm.num_snapshots_stored
    for p in others:
        _generate(warm, p)
    assert bm.num_snapshots_evicted >= stored
    if evicted == "snapshots":  # the prefix's K/V are still cached, its state is not
        h = None
        for i in range(0, len(PREFIX), 4):
            h = block_hash(h, tuple(PREFIX[i:i + 4]))
            assert h in bm.hash_to_block and h not in bm.snapshots
    rid, out = _generate(warm, SECOND)
    assert warm.requests == {} and bm.num_snapshot_hits == 0 and warm.scheduler.num_prefix_cache_hits == 0
    assert out == cold_out
    assert _logits_match(cfg, warm_rec.committed(rid, SECOND + out), cold_rec.committed(cold_id, SECOND + out)) is None
    _assert_released(warm)


def test_the_branch_point_of_two_prompts_becomes_a_snapshot(target):
    """No interval snapshots: the first prompt keeps its last full block only, so the second (sharing 32 tokens)
    misses, but keeps the state where the two part; a third prompt sharing the prefix resumes there."""
    model, cfg = target
    third = PREFIX + _ids(13, 53)
    cold = _engine(model, cfg, state_snapshot_interval=0)
    cold_rec = LogitsRecorder(cold)
    cold_id, cold_out = _generate(cold, third)
    warm = _engine(model, cfg, state_snapshot_interval=0)
    warm_rec = LogitsRecorder(warm)
    for prompt in (FIRST, SECOND):
        _generate(warm, prompt)
    assert warm.block_manager.num_snapshot_hits == 0
    rid, out = _generate(warm, third)
    assert warm.block_manager.num_snapshot_hits == 1 and warm.scheduler.num_prefix_cache_hits == 32
    assert out == cold_out
    # the cold run computes the third prompt in one piece, the warm one cut at 32: the recurrence's blocks differ
    warm_logits, cold_logits = warm_rec.committed(rid, third + out), cold_rec.committed(cold_id, third + out)
    assert max((warm_logits[p] - cold_logits[p]).abs().max().item() for p in cold_logits) <= 1e-6
    _assert_released(warm)


# -- the model: snapshots written by both recurrence paths -----------------------------------------------------
def _step(model, kv, table: list[int], slot: int, ids: list[int], start: int, *, source: int = -1,
          saves: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    from dspark.models.attention import SeqSpec, build_attn_metadata
    spec = SeqSpec(block_table=table, num_cached=start, num_query=len(ids), token_offset=0, state_slot=slot,
                   state_from=source, state_saves=saves)
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(ids), torch.arange(start, start + len(ids)),
                          build_attn_metadata([spec], num_tokens=len(ids), kv_block_size=8), kv)
        return model.compute_logits(hidden)


def test_snapshots_hold_the_state_a_step_ending_there_keeps(target):
    """A 30-token chunk saving after position 19 (the chunked recurrence cut there) and a 3-token window saving
    after 31 (the one-token loop): each snapshot equals the state a step ending at that position keeps in its
    slot; a step resuming from a snapshot gives the logits of the uncut run; a snapshot read at another position
    fails loudly."""
    model, cfg = target
    model.allocate_state(num_slots=2, window=4, dtype=torch.float32, device="cpu", num_snapshots=2)
    kv = [(torch.zeros(12, 8, *model.kv_spec), torch.zeros(12, 8, *model.kv_spec)) for _ in range(model.num_kv_layers)]
    a, b = list(range(6)), list(range(6, 12))
    ids = _ids(40, 5)
    _step(model, kv, a, 0, ids[:30], 0, saves=((19, 0),))
    _step(model, kv, a, 0, ids[30:33], 30, saves=((31, 1),))
    whole = _step(model, kv, b, 1, ids, 0)
    _step(model, kv, b, 1, ids[:20], 0)  # a step ending at 19: its slot keeps the state there
    for s in model.states:  # the window's snapshot is its ring entry; the chunk's, a state of another step (of
        for entry, pos, slot, tol in ((0, 19, 1, 1e-6), (1, 31, 0, 0.0)):  # other rows: products may round apart)
            conv, rec = s.start(slot, pos + 1)
            assert s.snap_positions[entry] == pos
            for got, want in ((s.snap_conv[entry], conv), (s.snap_recurrent[entry], rec)):
                assert (got - want).abs().max() <= tol
    resumed = _step(model, kv, a, 0, ids[20:], 20, source=0)
    assert (resumed - whole[20:]).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="snapshot 1 holds the state after position 31, not 19"):
        _step(model, kv, a, 0, ids[20:], 20, source=1)


# -- the block manager's bookkeeping -------------------------------------------------------------------------
def _bm(**kw) -> BlockManager:
    return BlockManager(**({"num_kv_blocks": 16, "kv_block_size": 4, "num_state_slots": 2, "num_state_snapshots": 3,
                            "snapshot_interval": 8} | kw))


def _computed(bm: BlockManager, req: Request, start: int, end: int) -> tuple[tuple[int, int], ...]:
    """One step over positions [start, end) of `req`: allocate, plan its snapshots, commit."""
    assert bm.allocate(req, end)
    saves = bm.plan_snapshots(req, start, end)
    req.num_computed_tokens = end
    bm.commit(req)
    return saves


def test_snapshot_boundaries_owners_and_reuse():
    bm = _bm()
    a = Request("a", list(range(3, 22)), SamplingParams())  # 19 tokens: the last full block before the last token: 16
    assert [p for p, _ in _computed(bm, a, 0, 10)] == [7]  # interval 8: the state after position 7
    assert [p for p, _ in _computed(bm, a, 10, 19)] == [15]  # 16: an interval multiple and the last full block
    assert bm.num_snapshots_stored == 2 and bm.num_used_snapshots == 2 and not bm.pending_snapshots["a"]
    b = Request("b", list(range(3, 22)) + [1], SamplingParams())
    assert bm.match_prefix(b, need_draft_kv=False) == 16 and bm.snapshot_entry(b) == bm.snapshots[bm.hash_state["b"][0][-1]]
    c = Request("c", list(range(3, 15)) + [9, 9, 9, 9, 9], SamplingParams())  # shares 12 tokens: 3 blocks, a snapshot at 8
    assert bm.match_prefix(c, need_draft_kv=False) == 8 and bm.branch_points["c"] == 12
    # the branch point (12) takes the last free entry; at c's last full block (16) every entry is held by a running
    # request's block: no snapshot there
    assert [p for p, _ in _computed(bm, c, 8, 17)] == [11]
    assert bm.num_used_snapshots == 3 and bm.num_snapshots_stored == 3
    for r in (a, b, c):
        bm.free_request(r)
    bm.check_invariants()
    # every entry is kept for a free cached block: a new snapshot takes the least recently used one (at 8)
    d = Request("d", [2] * 10, SamplingParams())
    assert [p for p, _ in _computed(bm, d, 0, 10)] == [7] and bm.num_snapshots_evicted == 1
    bm.free_request(d)
    # reusing the blocks frees the snapshots with them
    e = Request("e", [1] * 64, SamplingParams())
    assert bm.allocate(e, 64) and bm.num_used_snapshots == 0 and bm.num_snapshots_evicted == 4
    bm.free_request(e)
    bm.check_invariants()


def test_hybrid_prefix_caching_config_is_checked_before_weights_and_can_be_off(target):
    with pytest.raises(ValueError, match="max_state_snapshots"):
        CacheConfig(max_state_snapshots=-1)
    with pytest.raises(ValueError, match="state_snapshot_interval"):
        CacheConfig(state_snapshot_interval=-2)
    model, cfg = target
    engine = _engine(model, cfg, max_state_snapshots=0)
    assert not engine.block_manager.enable_prefix_caching
    assert run(engine, [FIRST, SECOND], greedy(4)) == run(make_engine(model, cfg, prefix=False), [FIRST, SECOND],
                                                          greedy(4))


def test_metrics_count_the_snapshots():
    from dspark.server.metrics import ServerStats, _EngineCollector
    cfg = CONFIGS["qwen3_5"]
    model, _ = tiny_target(cfg)
    engine = _engine(model, cfg)
    for prompt in (FIRST, SECOND):
        _generate(engine, prompt)
    samples = {s.name: s.value for family in _EngineCollector(lambda: ServerStats(engine=engine.stats())).collect()
               for s in family.samples}
    assert samples["vllm:state_snapshot_hits_total"] == 1
    assert samples["vllm:state_snapshots_stored_total"] == 4 and samples["vllm:state_snapshots_evicted_total"] == 0
    assert samples["vllm:num_state_snapshots"] == 16 and samples["vllm:num_state_snapshots_used"] == 4
