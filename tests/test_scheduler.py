"""Scheduler: token budget with mixed prompt chunks and decode/verify windows, preemption by
recompute, stop conditions inside an accepted run."""

import pytest

from dspark.config import SchedulerConfig
from dspark.engine.block_manager import BlockManager
from dspark.engine.scheduler import Scheduler
from dspark.request import Drafts, Request
from dspark.sampling import SamplingParams


def _sched(num_kv_blocks=64, budget=16, lookahead=0, **kw):
    bm = BlockManager(num_kv_blocks=num_kv_blocks, kv_block_size=4)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, **kw)
    return Scheduler(cfg, bm, max_model_len=256, num_lookahead_slots=lookahead), bm


def _commit_all(s, out, token=7, accepted=None):
    ids = {i.request.request_id: [token] * (1 + (accepted or {}).get(i.request.request_id, 0))
           for i in out.scheduled if i.emits}
    return s.commit(out, ids, accepted or {})


def test_chunked_prefill_and_decode_share_a_step():
    s, _ = _sched(budget=16)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=5))
    s.add(a)
    out = s.schedule()
    assert [(i.num_new_tokens, i.emits) for i in out.scheduled] == [(10, True)]
    _commit_all(s, out)
    assert a.num_computed_tokens == 10 and a.output_ids == [7] and a.is_decoding
    b = Request("b", list(range(100, 140)), SamplingParams(max_tokens=5))
    s.add(b)
    out = s.schedule()  # a decodes 1 token, b gets the rest of the budget as a chunk
    assert [(i.request.request_id, i.num_new_tokens, i.emits) for i in out.scheduled] == [
        ("a", 1, True), ("b", 15, False)]
    _commit_all(s, out)
    assert b.num_computed_tokens == 15 and b.output_ids == []


def test_verify_window_and_rollback_counter():
    s, _ = _sched(budget=16, lookahead=3)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    s.add(a)
    _commit_all(s, s.schedule())
    s.hold_drafts({"a": Drafts(ids=(4, 5, 6), verify_len=3)})
    out = s.schedule()
    item = out.scheduled[0]
    assert (item.num_new_tokens, item.num_drafts, item.num_logits) == (4, 3, 4)
    assert item.draft_ids == [4, 5, 6] and item.drafts.verify_len == 3  # the window carries its drafts
    # 1 of 3 drafts accepted: accepted + recovered emitted, committed length grows by 2
    emitted = s.commit(out, {"a": [4, 9]}, {"a": 1})
    assert emitted == {"a": [4, 9]} and "a" not in s.drafts  # the commit drops the verified drafts
    assert a.num_computed_tokens == 3 + 2 and a.all_ids == [1, 2, 3, 7, 4, 9] and a.is_decoding
    assert a.spec.num_drafts == 1 and a.spec.num_draft_tokens == 3 and a.spec.num_accepted_tokens == 1
    # blocks cover the committed length + window + drafter scratch
    assert len(a.block_table) * 4 >= 3 + 4 + 3


def test_stop_token_inside_accepted_run_truncates():
    s, _ = _sched(budget=16, lookahead=4)
    a = Request("a", [1, 2], SamplingParams(max_tokens=50, stop_token_ids=(42,)))
    s.add(a)
    _commit_all(s, s.schedule())
    s.hold_drafts({"a": Drafts(ids=(5, 42, 6, 8), verify_len=4)})
    out = s.schedule()
    emitted = s.commit(out, {"a": [5, 42, 6, 8, 3]}, {"a": 4})
    assert emitted == {"a": [5, 42]} and a.finish_reason == "stop" and a.is_finished
    assert a.output_ids == [7, 5, 42]


def test_max_tokens_inside_accepted_run():
    s, bm = _sched(budget=16, lookahead=4)
    a = Request("a", [1, 2], SamplingParams(max_tokens=3))
    s.add(a)
    _commit_all(s, s.schedule())
    s.hold_drafts({"a": Drafts(ids=(5, 6, 7, 8), verify_len=4)})
    out = s.schedule()
    emitted = s.commit(out, {"a": [5, 6, 7, 8, 9]}, {"a": 4})
    assert emitted == {"a": [5, 6]} and a.finish_reason == "length"
    assert bm.num_free_blocks == 64  # finished → blocks released


def test_preemption_by_recompute_loses_nothing():
    s, bm = _sched(num_kv_blocks=6, budget=64)
    reqs = [Request(f"r{i}", list(range(i * 10, i * 10 + 7)), SamplingParams(max_tokens=12))
            for i in range(3)]
    for r in reqs:
        s.add(r)
    preempted = 0
    for _ in range(200):
        if not s.has_unfinished():
            break
        out = s.schedule()
        preempted += len(out.preempted_ids)
        _commit_all(s, out)
        bm.check_invariants()
    assert preempted > 0, "a 6-block pool must force preemption"
    assert all(r.is_finished and len(r.output_ids) == 12 for r in reqs)
    assert bm.num_free_blocks == 6


def test_held_drafts_wait_for_their_window_and_go_with_preemption_or_abort():
    """Drafts are the scheduler's to hold: a request the budget leaves out keeps them for its next window; a
    preemption or an abort drops them; a window with no drafts is a plain decode."""
    s, _ = _sched(budget=16, lookahead=15)
    a, b = (Request(n, [1, 2], SamplingParams(max_tokens=50)) for n in "ab")
    for r in (a, b):
        s.add(r)
    _commit_all(s, s.schedule())
    _commit_all(s, s.schedule())  # both decoding now
    s.hold_drafts({"a": Drafts(ids=tuple(range(20, 40)), verify_len=20), "b": Drafts(ids=(7,), verify_len=1)})
    out = s.schedule()  # a's window [last, 20..34] fills the budget of 16: b waits, holding its draft
    assert [(i.request.request_id, i.draft_ids) for i in out.scheduled] == [("a", list(range(20, 35)))]
    _commit_all(s, out)
    assert "a" not in s.drafts and s.drafts["b"].ids == (7,)
    out = s.schedule()
    assert [(i.request.request_id, i.draft_ids) for i in out.scheduled][0] == ("a", [])
    s._preempt(b)
    assert "b" not in s.drafts
    s.hold_drafts({"a": Drafts(ids=(5,), verify_len=1)})
    s.finish_request(a, "abort")
    assert not s.drafts


def test_abort_frees_blocks():
    s, bm = _sched()
    a = Request("a", list(range(30)), SamplingParams())
    s.add(a)
    s.schedule()
    assert bm.num_free_blocks < 64
    s.finish_request(a, "abort")
    assert bm.num_free_blocks == 64 and a.finish_reason == "abort"
    assert s.take_finished() == [a] and not s.has_unfinished()


def test_coalescing_holds_prompts_a_bounded_number_of_steps():
    s, _ = _sched(budget=256, coalesce_steps=2)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    s.add(a)
    _commit_all(s, s.schedule())
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=50))
    s.add(b)
    held = 0
    for _ in range(5):
        out = s.schedule()
        ids = [i.request.request_id for i in out.scheduled]
        _commit_all(s, out)
        if "b" in ids:
            break
        held += 1
    assert held == 2


def test_coalescing_admits_at_once_prompts_that_fill_half_a_step():
    s, _ = _sched(budget=256, coalesce_steps=4)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    s.add(a)
    _commit_all(s, s.schedule())
    s.add(Request("b", list(range(3, 103)), SamplingParams(max_tokens=50)))  # 100 tokens: held
    assert [i.request.request_id for i in s.schedule().scheduled] == ["a"]
    s.add(Request("c", list(range(3, 53)), SamplingParams(max_tokens=50)))  # 150 waiting of 255: admitted
    assert sorted(i.request.request_id for i in s.schedule().scheduled) == ["a", "b", "c"]


def test_waiting_requests_take_turns_by_client():
    """A batch of one client queued first; another client's single request is admitted after the batch's
    first, not after all of it; requests of no client keep their arrival order."""
    s, _ = _sched(budget=64, max_num_seqs=1)
    params = SamplingParams(max_tokens=1)
    for i in range(6):
        s.add(Request(f"a{i}", [1, 2], params, client="batch"))
    s.add(Request("probe", [1, 2], params, client="probe"))
    s.add(Request("b0", [1, 2], params, client="other"))
    s.add(Request("a6", [1, 2], params, client="batch"))
    s.add(Request("loose0", [1, 2], params))
    s.add(Request("loose1", [1, 2], params))
    assert [r.request_id for r in s.waiting] == ["a0", "probe", "b0", "loose0", "loose1", "a1", "a2", "a3", "a4",
                                                 "a5", "a6"]
    admitted = []
    for _ in range(4):  # one running at a time: each step admits the head, which finishes (max_tokens 1)
        out = s.schedule()
        admitted += [item.request.request_id for item in out.scheduled]
        _commit_all(s, out)
    assert admitted == ["a0", "probe", "b0", "loose0"]
    s.add(Request("late", [1, 2], params, client="late"))  # behind the turn the queue's head is on
    assert [r.request_id for r in s.waiting][:3] == ["loose1", "late", "a1"]


@pytest.mark.parametrize("coalesce", [0, 2])
def test_a_long_prompt_leaves_room_for_a_waiting_request(coalesce):
    """A 400-token prompt computed in chunks of a 64-token budget keeps a quarter of each step for the waiting head
    once it has waited `coalesce_steps` steps: a short request starts long before the long prompt is done."""
    s, _ = _sched(num_kv_blocks=256, budget=64, coalesce_steps=coalesce)
    params = SamplingParams(max_tokens=4)
    s.add(Request("long", list(range(3, 403)), params))
    _commit_all(s, s.schedule())
    s.add(Request("short", [1, 2, 3, 4, 5], params))
    admitted_at = None
    for step in range(1, 8):
        out = s.schedule()
        if any(item.request.request_id == "short" for item in out.scheduled):
            admitted_at = step
            break
        _commit_all(s, out)
    long_req = next(r for r in s.running if r.request_id == "long")
    assert admitted_at == coalesce + 1 and long_req.num_uncomputed_tokens > 64, admitted_at
    assert sum(item.num_new_tokens for item in out.scheduled) == 64  # the budget is still spent whole


def test_decoding_requests_come_before_a_long_prompts_chunk():
    """A request that is answering gets its token in every step even when an earlier request's prompt chunk could
    take the whole budget."""
    s, _ = _sched(num_kv_blocks=256, budget=64, coalesce_steps=0)
    params = SamplingParams(max_tokens=8)
    s.add(Request("long", list(range(3, 403)), params))
    _commit_all(s, s.schedule())
    s.add(Request("short", [1, 2, 3], params))
    for _ in range(5):
        out = s.schedule()
        _commit_all(s, out)
    short = next(r for r in s.running if r.request_id == "short")
    assert len(short.output_ids) >= 4  # a token a step once admitted, while the long prompt is still chunked
    assert next(r for r in s.running if r.request_id == "long").num_uncomputed_tokens > 1
