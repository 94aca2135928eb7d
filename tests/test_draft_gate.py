"""Tests for dspark/speculation/draft_gate.py and dspark/speculation/admission.py: the gate's decision from the cost
table and past survivals, its probes, its live step-time and verified-window corrections, the proposal
skip for lookup-only drafts, and drafter-less admission by load.

    pytest tests/test_draft_gate.py -q
"""

from __future__ import annotations

import pytest
import torch

from dspark.speculation.admission import AdmissionRule
from dspark.speculation.cost_table import CostTable
from dspark.speculation.draft_gate import DraftGate


def test_draft_gate_decides_from_cost_and_past_survival():
    cheap = CostTable(num_tokens=[1, 64], steps_per_second=[100.0, 100.0], draft_num_reqs=[1, 16], draft_seconds=[0.001, 0.001])
    costly = CostTable(num_tokens=[1, 64], steps_per_second=[100.0, 50.0], draft_num_reqs=[1, 16], draft_seconds=[0.02, 0.02])
    gate = DraftGate(probe_every=4)
    assert gate.should_draft(num_reqs=2, num_nondraft_tokens=2, cost=costly), "no history yet: draft"
    gate.observe(torch.full((2, 4), 0.5))  # survival 0.5, 0.25, ...: at most ~1 extra token per request
    # cheap drafts on a flat curve: drafting pays
    assert gate.expected_gain(num_reqs=2, num_nondraft_tokens=2, cost=cheap) > 1.0
    assert gate.should_draft(num_reqs=2, num_nondraft_tokens=2, cost=cheap)
    # a draft costing 2 steps cannot pay for < 1 expected extra token per request
    assert gate.expected_gain(num_reqs=2, num_nondraft_tokens=2, cost=costly) < 1.0
    decisions = [gate.should_draft(num_reqs=2, num_nondraft_tokens=2, cost=costly) for _ in range(8)]
    assert decisions == [False, False, False, True, True, False, False, False], \
        "skip, but probe two steps every probe_every steps"
    # near-certain drafts pay even at that price
    gate.decay = 0.0
    gate.observe(torch.full((2, 4), 0.999))
    assert gate.should_draft(num_reqs=2, num_nondraft_tokens=2, cost=costly)
    with pytest.raises(ValueError):
        DraftGate(probe_every=0)


def test_draft_gate_admits_without_drafter_context_where_the_load_cannot_pay():
    """`admits_model_drafting` says no where drafting could not pay at the joining load even with the long-run
    survival curve: yes before LONG_MIN_PROPOSALS proposals or without a table; a run of poor drafts at a
    light load (the fast curve) does not turn it; a load where no curve pays does."""
    # a step of up to 8 tokens costs one token's time, beyond that time ∝ tokens (every size profiled): drafts
    # pay at 1 request, and no curve pays at 64, where a verified token costs a decoded one's
    sizes = list(range(1, 513))
    bends = CostTable(num_tokens=sizes, steps_per_second=[100.0 / max(1.0, b / 8) for b in sizes],
                      draft_num_reqs=[1, 64], draft_seconds=[0.003, 0.02])
    gate = DraftGate(probe_every=1000)
    assert gate.admits_model_drafting(num_reqs=64, cost=bends), "no proposal yet: nothing to judge by"
    for _ in range(AdmissionRule.LONG_MIN_PROPOSALS):
        gate.observe(torch.full((1, 4), 0.9))
        # (before LONG_MIN_PROPOSALS the fast curve stands in for the long-run one)
        assert not gate.admits_model_drafting(num_reqs=64, cost=bends)
        assert gate.admits_model_drafting(num_reqs=1, cost=bends)
    assert gate.admits_model_drafting(num_reqs=1, cost=bends)
    assert gate.admits_model_drafting(num_reqs=64, cost=None), "no table: nothing to decide from"
    for _ in range(34):
        gate.observe(torch.full((1, 4), 0.9))
    for _ in range(10):  # the text turns hard: the gate skips at 1 request, admission still says yes there
        gate.observe(torch.full((1, 4), 0.05))
    assert not gate.should_draft(num_reqs=1, num_nondraft_tokens=1, cost=bends)
    assert gate.admits_model_drafting(num_reqs=1, cost=bends), "the text closed the gate, not the load"
    assert not gate.admits_model_drafting(num_reqs=64, cost=bends)
    # not even lookup drafts pay (proposing skipped, its probes aside, SKIPPED_PROPOSALS_ADMIT times in a row): no
    # drafter runs at this load, whatever the curve
    linear = CostTable(num_tokens=sizes, steps_per_second=[100.0 / b for b in sizes])
    fresh = DraftGate(probe_every=1000)
    fresh.observe_proposal(seconds=0.01, confidence=torch.full((2, 4), 0.01), num_proposed=[1, 0])
    for _ in range(AdmissionRule.SKIPPED_PROPOSALS_ADMIT):
        assert fresh.admits_model_drafting(num_reqs=2, cost=linear)
        assert not fresh.proposing_pays(num_reqs=2, num_nondraft_tokens=2, cost=linear)
    assert not fresh.admits_model_drafting(num_reqs=2, cost=linear)
    fresh.observe_proposal(seconds=1e-6, confidence=torch.full((2, 4), 0.99), num_proposed=[4, 4])
    assert fresh.proposing_pays(num_reqs=2, num_nondraft_tokens=2, cost=bends)
    assert fresh.admits_model_drafting(num_reqs=2, cost=linear), "proposing pays again: the streak is over"
    # a drafter whose drafts rarely pass: no load is light enough
    poor = DraftGate()
    for _ in range(AdmissionRule.LONG_MIN_PROPOSALS):
        poor.observe(torch.full((1, 4), 0.05))
    assert not poor.admits_model_drafting(num_reqs=1, cost=bends)


def test_proposing_is_skipped_where_lookup_drafts_cannot_pay_for_it():
    """Proposing without the model (prompt lookup) is worth what the recent free proposals' survivals
    (pooled, resampled to the load) gain at the load, against the measured proposing seconds. On a
    curve linear in the batch (compute-bound: a verified token costs a decoded one's) it gains nothing
    and is skipped, with a probe every 2 × probe_every steps; on a flat curve it pays; on a curve that
    turns linear it pays at 1 request and not at 64 — where a few sure matches among many requests
    still pay (the spread counts, not the mean). Before any proposal or without a table: propose."""
    sizes = list(range(1, 129))  # every size profiled: time ∝ B
    linear = CostTable(num_tokens=sizes, steps_per_second=[64.0 / b for b in sizes])
    flat = CostTable(num_tokens=[1, 512], steps_per_second=[100.0, 100.0])
    bends = CostTable(num_tokens=[1, 16, 32, 64, 128, 256], steps_per_second=[100.0, 90.0, 60.0, 30.0, 15.0, 7.5])
    gate = DraftGate(probe_every=4)
    assert gate.proposing_pays(num_reqs=16, num_nondraft_tokens=16, cost=linear), "nothing observed yet"
    confidence = torch.full((16, 4), 0.9)
    gate.observe_proposal(seconds=0.0002 * 16, confidence=confidence, num_proposed=[4] * 8 + [0] * 8)
    assert gate.propose_seconds_per_req == pytest.approx(0.0002)
    decisions = [gate.proposing_pays(num_reqs=16, num_nondraft_tokens=16, cost=linear) for _ in range(16)]
    assert decisions == [False] * 7 + [True] + [False] * 7 + [True], "skip, probing every 8 steps"
    assert gate.proposing_pays(num_reqs=16, num_nondraft_tokens=16, cost=flat)
    assert gate.proposing_pays(num_reqs=1, num_nondraft_tokens=1, cost=bends)
    assert not gate.proposing_pays(num_reqs=64, num_nondraft_tokens=64, cost=bends)
    # a long prompt chunk riding the step: its time is the prompt's, the drafts still pay nothing
    assert not gate.proposing_pays(num_reqs=16, num_nondraft_tokens=80, num_prompt_tokens=64, cost=linear)
    assert gate.proposing_pays(num_reqs=16, num_nondraft_tokens=16, cost=None), "no table: nothing to decide from"
    # 2 of 16 requests with near-sure matches (the rest none) on a curve whose verified token costs 0.6 of
    # a decoded one: pays, though a mean curve (survival ~0.12) would say it cannot
    bent = CostTable(num_tokens=sizes, steps_per_second=[100.0 / (16 + 0.6 * (b - 16)) if b > 16 else 100.0 / 16
                                                         for b in sizes])
    sparse = DraftGate(probe_every=4)
    sparse.observe_proposal(seconds=0.0001 * 16, confidence=torch.full((16, 4), 0.97),
                            num_proposed=[4, 4] + [0] * 14)
    assert sparse.proposing_pays(num_reqs=16, num_nondraft_tokens=16, cost=bent)
    assert not sparse.proposing_pays(num_reqs=16, num_nondraft_tokens=16, cost=linear)


def test_draft_gate_corrects_overconfident_heads_from_verified_windows():
    cost = CostTable(num_tokens=[1, 64], steps_per_second=[100.0, 80.0], draft_num_reqs=[1, 16],
                     draft_seconds=[0.005, 0.005])
    gate = DraftGate()
    gate.observe(torch.full((1, 4), 0.9))  # the head promises ~3 accepted drafts per window
    assert gate.correction == 1.0 and gate.expected_gain(num_reqs=1, num_nondraft_tokens=1, cost=cost) > 1.0
    for _ in range(30):  # ... but the target accepts none of them
        gate.observe_verify("r", [0.9] * 4, 4, 0)
    assert gate.correction == pytest.approx(0.1)  # clipped at the floor
    assert gate.expected_gain(num_reqs=1, num_nondraft_tokens=1, cost=cost) < 1.0
    for _ in range(200):  # the head turns out right after all
        gate.observe_verify("r", [0.9] * 4, 4, 3)
    assert gate.correction == pytest.approx(3 / (0.9 + 0.81 + 0.729 + 0.6561), rel=0.05)


def test_draft_gate_corrects_the_table_with_live_step_times():
    cost = CostTable(num_tokens=[1, 64], steps_per_second=[100.0, 80.0], draft_num_reqs=[1, 16],
                     draft_seconds=[0.004, 0.004])
    gate = DraftGate(plain_probe_every=1000)
    gate.observe(torch.full((1, 4), 0.4))
    gain = gate.expected_gain(num_reqs=1, num_nondraft_tokens=1, cost=cost)
    assert 1.15 < gain < 1.4, gain  # the table alone says: draft
    assert gate.should_draft(num_reqs=1, num_nondraft_tokens=1, cost=cost)
    # transitions (drafts verified but none proposed, or the reverse) are not timed
    gate.observe_step(num_tokens=5, seconds=1.0, drafts_verified=True, num_proposed_reqs=0, cost=cost)
    gate.observe_step(num_tokens=1, seconds=1.0, drafts_verified=False, num_proposed_reqs=1, cost=cost)
    assert gate.time_ratio == {"draft": None, "plain": None} and gate.live_factor is None
    # live: plain steps take the table's time, drafting steps 1.5x theirs -> drafting does not pay
    for _ in range(40):
        gate.observe_step(num_tokens=1, seconds=cost.step_seconds(1), drafts_verified=False,
                          num_proposed_reqs=0, cost=cost)
        gate.observe_step(num_tokens=5, seconds=1.5 * (cost.step_seconds(5) + 0.004), drafts_verified=True,
                          num_proposed_reqs=1, cost=cost)
    assert gate.live_factor == pytest.approx(1 / 1.5, rel=1e-3)
    assert not gate.should_draft(num_reqs=1, num_nondraft_tokens=1, cost=cost)
    # the other way round: plain steps run 1.3x slow live, drafting ones as profiled -> a table gain
    # below the no-live margin still drafts
    gate.observe(torch.full((1, 4), 0.3))
    gate.decay = 0.0
    gate.observe(torch.full((1, 4), 0.3))
    gain = gate.expected_gain(num_reqs=1, num_nondraft_tokens=1, cost=cost)
    assert 1.0 < gain < DraftGate.MIN_GAIN, gain
    for _ in range(60):
        gate.observe_step(num_tokens=1, seconds=1.3 * cost.step_seconds(1), drafts_verified=False,
                          num_proposed_reqs=0, cost=cost)
        gate.observe_step(num_tokens=5, seconds=cost.step_seconds(5) + 0.004, drafts_verified=True,
                          num_proposed_reqs=1, cost=cost)
    assert gate.live_factor == pytest.approx(1.3, rel=1e-2)
    gate.steps_without_draft = 0
    assert gate.should_draft(num_reqs=1, num_nondraft_tokens=1, cost=cost)


def test_draft_gate_probes_plain_decoding_two_steps_at_a_time():
    cost = CostTable(num_tokens=[1, 64], steps_per_second=[100.0, 100.0], draft_num_reqs=[1, 16],
                     draft_seconds=[0.0001, 0.0001])
    gate = DraftGate(plain_probe_every=4)
    gate.observe(torch.full((1, 4), 0.95))
    assert [gate.should_draft(num_reqs=1, num_nondraft_tokens=1, cost=cost) for _ in range(4)] == [True] * 4, \
        "no plain probe before a drafting step was timed"
    gate.observe_step(num_tokens=5, seconds=0.02, drafts_verified=True, num_proposed_reqs=1, cost=cost)
    decisions = [gate.should_draft(num_reqs=1, num_nondraft_tokens=1, cost=cost) for _ in range(10)]
    assert decisions == [False, False, True, True, True, False, False, True, True, True], decisions


def test_draft_gate_probes_a_few_requests_in_turn_and_backs_off():
    costly = CostTable(num_tokens=[1, 64], steps_per_second=[100.0, 50.0], draft_num_reqs=[1, 16],
                       draft_seconds=[0.02, 0.02])
    gate = DraftGate(probe_every=2, probe_reqs=2)
    gate.observe(torch.full((6, 4), 0.3))
    picks = [gate.drafted_requests(num_reqs=6, num_nondraft_tokens=6, cost=costly) for _ in range(40)]
    drafting = [i for i, p in enumerate(picks) if p]
    assert all(len(picks[i]) == 2 for i in drafting), "probes draft for probe_reqs requests only"
    # probe runs of two steps; the wait between them doubles after each unconvincing probe, capped at 4x
    starts = [i for i in drafting if i - 1 not in drafting]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # (a gap = the probe run + the post-probe decision + the interval of skipped steps)
    assert gaps[0] == 2 + 4 - 1 and set(gaps[1:]) == {2 + 8 - 1}, gaps
    # in turn: every request gets probed
    assert {r for i in drafting for r in picks[i]} == set(range(6))
    # with few requests a probe covers them all
    assert len(DraftGate(probe_reqs=2).drafted_requests(num_reqs=1, num_nondraft_tokens=1, cost=costly)) == 1
    # with each request's missing drafter context given, probes take the requests with the least
    gate = DraftGate(probe_every=2, probe_reqs=2)
    gate.observe(torch.full((6, 4), 0.3))
    backlog = [40, 0, 64, 3, 0, 17]
    picks = [gate.drafted_requests(num_reqs=6, num_nondraft_tokens=6, cost=costly, backlog=backlog)
             for _ in range(12)]
    assert {tuple(p) for p in picks if p} == {(1, 4)}, picks


def test_draft_gate_gain_follows_the_curve_and_the_cost():
    """The gain is cached between proposals; a new curve, a verify outcome or another table moves it."""
    cheap = CostTable(num_tokens=[1, 64], steps_per_second=[100.0, 90.0], draft_num_reqs=[1, 16],
                      draft_seconds=[0.001, 0.001])
    costly = CostTable(num_tokens=[1, 64], steps_per_second=[100.0, 20.0], draft_num_reqs=[1, 16],
                       draft_seconds=[0.02, 0.02])
    gate = DraftGate()
    gate.observe(torch.full((4, 4), 0.9))
    high = gate.expected_gain(num_reqs=4, num_nondraft_tokens=4, cost=cheap)
    assert gate.expected_gain(num_reqs=4, num_nondraft_tokens=4, cost=cheap) == high
    assert gate.expected_gain(num_reqs=4, num_nondraft_tokens=4, cost=costly) < high
    gate.observe(torch.full((4, 4), 0.2))
    assert gate.expected_gain(num_reqs=4, num_nondraft_tokens=4, cost=cheap) < high
    lowered = gate.expected_gain(num_reqs=4, num_nondraft_tokens=4, cost=cheap)
    for _ in range(10):  # realized acceptance above the predicted: the correction lifts the curve
        gate.observe_verify("r", [0.9] * 4, 4, 4)
    assert gate.expected_gain(num_reqs=4, num_nondraft_tokens=4, cost=cheap) > lowered
