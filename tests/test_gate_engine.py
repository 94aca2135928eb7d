"""The draft gate, drafter-less admission and the measured switch on the serving path, on a tiny random
Llama target with a random-weight DSpark drafter: steps where drafting cannot pay are skipped and the
output is unchanged; skipped requests defer their drafter context; proposing stops where even lookup
drafts cannot pay; requests admitted while the gate is closed (or the load is measured off) get no
drafter context; a switch turning on and off keeps greedy parity.

    pytest tests/test_gate_engine.py -q
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.speculation.cost_table import CostTable
from dspark.speculation.length_policy import (
    AsyncPrefixScheduler,
    PrefixScheduler,
)
from tests.conftest import TINY_LLAMA
from tests.engine_helpers import greedy
from tests.scheduled_helpers import (  # noqa: F401  (fixtures)
    ARRIVAL_STEPS, COSTLY_DRAFTS, FLAT, MAX_TOKENS, MILD, POLICIES, _mismatches, _prompts,
    _spec_engine, drafter_dir, plain_outputs, run_staged, target)

# -- the draft gate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["prefix", "async"])
def test_draft_gate_skips_unprofitable_steps_and_stays_lossless(target, drafter_dir, plain_outputs, policy):
    make_policy = POLICIES[policy][0]
    engine = _spec_engine(target, drafter_dir, make_policy(), cost=COSTLY_DRAFTS, coalesce_steps=2)
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    m = engine.metrics
    assert m.num_draft_skips > 0, "drafting at 5 steps' cost must be skipped"
    assert m.num_drafts > 0, "the gate must still probe (draft every probe_every steps)"
    bm = engine.block_manager
    assert bm.num_free_blocks == len(bm.blocks)
    # with the gate off the same policy drafts every step
    ungated = _spec_engine(target, drafter_dir, make_policy(), cost=COSTLY_DRAFTS, coalesce_steps=2,
                           draft_gate=False)
    run_staged(ungated, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert ungated.metrics.num_draft_skips == 0 and ungated.spec.draft_gate is None


def test_skipped_requests_defer_drafter_context_and_draft_the_same(target, drafter_dir, plain_outputs):
    """While the gate skips a request its drafter context waits (no drafter work in that step) and is
    extended, with the proposing step's positions, in one call. Same scripted gate decisions with and
    without deferral: every proposal (draft ids; confidences up to rounding) and every output are the
    same, and the drafter's context is extended in fewer calls."""
    runs = []
    for defer in (True, False):
        # fp32 products: bf16 ones switch on by batch size (`Linear.LOWP_MIN_ROWS`), and deferral
        # changes the batch sizes of context extension; no measured switch: it reads the wall clock, and
        # on a busy machine it turned speculation off at some loads in one run and not the other
        engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD, coalesce_steps=2,
                              draft_matmul_dtype="float32", measured_switch=False)
        if not defer:
            engine.spec.MAX_DEFERRED_BYTES = 0
        # nor the gate's wall-clock observations (step and proposal seconds): on a loaded machine they
        # made one run stop proposing where the other did not (20 vs 8 proposals in one CI run)
        engine.spec.draft_gate.observe_step = lambda **_: None
        engine.spec.draft_gate.observe_proposal = lambda **_: None
        step = {"n": 0}
        # drafting in 2 of every 7 steps, per request in turn; the rest plain
        engine.spec.draft_gate.drafted_requests = lambda *, num_reqs, **_: (
            [i for i in range(num_reqs) if (step["n"] + i) % 7 in (0, 3)])
        calls = {"extend": 0, "propose": []}
        extend, propose = engine.drafter.extend_context, engine.drafter.propose

        def counted_extend(update, _f=extend):
            calls["extend"] += 1
            return _f(update)

        def recorded_propose(batch, _f=propose):
            out = _f(batch)
            calls["propose"].append(([r.request_id for r in batch.requests], out.draft_ids.tolist(),
                                     out.confidence.tolist()))
            return out
        engine.drafter.extend_context, engine.drafter.propose = counted_extend, recorded_propose
        original_step = engine.step

        def counting_step(_f=original_step):
            step["n"] += 1
            return _f()
        engine.step = counting_step
        staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
        assert _mismatches(staged.outputs, plain_outputs) == 0
        bm = engine.block_manager
        assert bm.num_free_blocks == len(bm.blocks)
        runs.append((calls, engine.metrics.num_steps))
    (deferred, steps), (eager, _) = runs
    assert len(deferred["propose"]) == len(eager["propose"]) > 3
    for (ids_d, drafts_d, conf_d), (ids_e, drafts_e, conf_e) in zip(deferred["propose"], eager["propose"]):
        assert ids_d == ids_e and drafts_d == drafts_e, "deferral changed a proposal"
        # the context K/V were computed over differently shaped batches: equal up to rounding
        assert torch.allclose(torch.tensor(conf_d), torch.tensor(conf_e), atol=1e-5)
    assert deferred["extend"] < eager["extend"] <= steps, (deferred["extend"], eager["extend"])


def test_proposing_stops_where_even_lookup_drafts_cannot_pay_and_output_is_unchanged(target, drafter_dir,
                                                                                     plain_outputs):
    """On a step-cost curve linear in the batch (every size profiled, drafter time as dear) neither the
    model nor prompt lookup can pay: after the first lookup proposals the engine stops proposing (a
    probe now and then), and the output is plain decoding's. On a flat curve it never stops."""
    sizes = list(range(1, 257))
    linear = CostTable(num_tokens=sizes, steps_per_second=[100.0 / b for b in sizes],
                       draft_num_reqs=[1, 64], draft_seconds=[0.05, 0.05])
    counts = {}
    for name, cost in (("linear", linear), ("flat", FLAT)):
        engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=cost, coalesce_steps=2,
                              ngram_first=True)
        staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
        assert _mismatches(staged.outputs, plain_outputs) == 0
        counts[name] = (engine.metrics.num_proposal_skips, engine.metrics.num_steps)
        assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    skips, steps = counts["linear"]
    assert skips > steps // 2, counts
    assert counts["flat"][0] == 0, counts


@pytest.mark.parametrize("budget_rows", [None, 6])
def test_a_closed_gate_extends_prompts_only_and_bounds_the_kept_taps(target, drafter_dir, plain_outputs,
                                                                     budget_rows):
    """With the gate closed for good, the drafter context covers the prompts (their drafter K/V make a
    later prefix hit a draft hit) and no generated position: those wait, and are dropped when their
    request finishes. Under a small budget of kept taps the longest backlogs are extended instead, and
    after every step the kept taps fit the budget. Output equals plain decoding either way."""
    engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD, coalesce_steps=2,
                          draft_matmul_dtype="float32")
    prompts = _prompts()
    row_bytes = len(engine.drafter.tap_layer_ids) * TINY_LLAMA.hidden_size * 4  # fp32 taps
    if budget_rows is not None:
        engine.spec.MAX_DEFERRED_BYTES = budget_rows * row_bytes
    engine.spec.draft_gate.drafted_requests = lambda **_: []
    extended: list[tuple[str, int, int]] = []  # (request id, first position, positions)
    prompt_len: dict[str, int] = {}
    extend = engine.drafter.extend_context

    def recorded_extend(update, _f=extend):
        extended.extend((s.request_id, s.start_pos, len(s.token_ids)) for s in update.segments)
        prompt_len.update((s.request_id, len(engine.requests[s.request_id].prompt_ids)) for s in update.segments)
        return _f(update)
    engine.drafter.extend_context = recorded_extend
    kept: list[int] = []
    original_step = engine.step

    def step_noting_backlog(_f=original_step):
        out = _f()
        kept.append(sum(r.num_pending_positions for r in engine.requests.values()))
        return out
    engine.step = step_noting_backlog
    staged = run_staged(engine, prompts, greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert engine.metrics.num_draft_tokens == 0
    covered: dict[str, int] = {}
    for rid, start, n in extended:
        # (a request may start past a prefix-cache hit that carried the drafter's K/V)
        assert start == covered.get(rid, start) and (rid in covered or start < prompt_len[rid]), \
            "drafter context extended out of order"
        covered[rid] = start + n
    assert len(covered) == len(prompts)
    if budget_rows is None:  # the prompts and nothing generated
        assert all(covered[rid] == prompt_len[rid] for rid in covered), (covered, prompt_len)
        assert max(kept) > 6, "the budget case below would not bind"
    else:
        assert max(kept) <= budget_rows, kept
        assert any(covered[rid] > prompt_len[rid] for rid in covered), "the budget flushed nothing"
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


def test_requests_admitted_while_the_gate_stays_closed_get_no_drafter_context(target, drafter_dir, plain_outputs):
    """A request admitted where the gate says drafting cannot pay at its load (`admits_model_drafting`, scripted
    here; its rule is tested in test_length_policy) gets no drafter context: no extension over its prompt, no taps in steps that carry only such requests, never a
    model proposal (prompt lookup still drafts for it), and its prefix-cache hits need no drafter K/V.
    Requests admitted before the gate closed keep theirs. Output equals plain decoding."""
    engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=MILD, coalesce_steps=2, ngram_first=True)
    gate = engine.spec.draft_gate
    closed_from = 3  # the first three prompts are admitted while the gate is open
    engine.spec.draft_gate.drafted_requests = lambda *, num_reqs, **_: []  # the gate never lets the model draft
    admitted: dict[str, bool] = {}
    admit = engine.scheduler.model_drafting

    gate.admits_model_drafting = lambda **_: len(admitted) < closed_from  # (the gate's rule: test_length_policy)

    def recording_admit(load, context_tokens, _f=admit):
        ok = _f(load, context_tokens)
        admitted[f"n{len(admitted)}"] = ok
        return ok
    engine.scheduler.model_drafting = recording_admit
    extended: set[str] = set()
    extend = engine.drafter.extend_context

    def recorded_extend(update, _f=extend):
        extended.update(s.request_id for s in update.segments)
        return _f(update)
    engine.drafter.extend_context = recorded_extend
    forward, taps_seen = engine.runner.forward, []

    def recorded_forward(batch, *, with_taps=True, _f=forward):
        logits, taps = _f(batch, with_taps=with_taps)
        taps_seen.append((with_taps, taps is not None))
        return logits, taps
    engine.runner.forward = recorded_forward
    prompts = _prompts()
    staged = run_staged(engine, prompts, greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert list(admitted.values()) == [True] * closed_from + [False] * (len(prompts) - closed_from)
    early = {f"req-{i}" for i in range(closed_from)}  # (the engine's ids follow the arrival order)
    assert extended == early, "drafter context for a request admitted while the gate was closed"
    assert all(w == t for w, t in taps_seen) and (False, False) in taps_seen
    assert engine.metrics.num_lookup_drafts > 0, "prompt lookup must still draft for them"
    # the same prompts again, all admitted lookup-only: they take the prefix hits of blocks without drafter
    # K/V (the later requests' blocks), which a request with a drafter context could not
    again = engine.add_request(prompts[-2], greedy(MAX_TOKENS))
    engine.step()
    assert engine.requests[again].num_cached_tokens > 0 and not engine.requests[again].model_drafting
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics.num_admitted_without_drafter == len(prompts) - closed_from + 1
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


def test_a_load_measured_off_proposes_nothing_and_admits_without_drafter_context(target, drafter_dir, plain_outputs):
    """Where the measured switch (dspark/speculation/switch.py; its rule: tests/test_switch.py) has found
    speculation slower than plain decoding, scripted here for every load: no proposal at all (lookup
    included), no drafts verified, every request admitted without drafter context (no extension, no taps),
    and output equal to plain decoding. Off in the config, the engine has no switch."""
    engine = _spec_engine(target, drafter_dir, PrefixScheduler(), cost=FLAT, coalesce_steps=2, ngram_first=True,
                          measured_switch=True)
    switch = engine.spec.switch
    switch.propose = lambda **_: False  # every load measured off, and no speculative probe in this run
    switch.is_off = lambda **_: True
    proposed: list[int] = []
    propose = engine.drafter.propose

    def recorded_propose(batch, _f=propose):
        proposed.append(len(batch.requests))
        return _f(batch)
    engine.drafter.propose = recorded_propose
    extended: list[str] = []
    extend = engine.drafter.extend_context

    def recorded_extend(update, _f=extend):
        extended.extend(s.request_id for s in update.segments)
        return _f(update)
    engine.drafter.extend_context = recorded_extend
    prompts = _prompts()
    staged = run_staged(engine, prompts, greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert proposed == [] and extended == []
    assert engine.metrics.num_draft_tokens == 0 and engine.metrics.num_measured_off_steps > 0
    assert engine.metrics.num_admitted_without_drafter == len(prompts)
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    assert _spec_engine(target, drafter_dir, PrefixScheduler(), cost=FLAT, measured_switch=False).spec.switch is None


@pytest.mark.parametrize("policy", ["prefix", "async"])
def test_a_switch_turning_on_and_off_keeps_greedy_parity(target, drafter_dir, plain_outputs, policy):
    """Speculation switched off and on again mid-request (scripted: three steps on, two off, over and over):
    drafts proposed before an "off" step are still verified in it, none are proposed in it, and the output
    equals plain decoding."""
    engine = _spec_engine(target, drafter_dir, PrefixScheduler() if policy == "prefix" else AsyncPrefixScheduler(),
                          cost=FLAT, coalesce_steps=2, ngram_first=True, measured_switch=True)
    pattern = itertools.cycle([True, True, True, False, False])
    engine.spec.switch.propose = lambda **_: next(pattern)
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert engine.metrics.num_draft_tokens > 0 and engine.metrics.num_measured_off_steps > 0
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


