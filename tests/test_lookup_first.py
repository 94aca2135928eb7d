"""Prompt lookup first (`"ngram_first": true`, dspark/drafters/lookup_first.py):

* the n-gram lookup (dspark/drafters/ngram.py) against a brute-force scan on random sequences; the
  cross-request cache (longest n, latest occurrence, bounded, asked only where the own context has
  no match);
* the lookup's acceptance counts against hand-counted rounds (conditional per position, per regime
  and match length, halved at the cap);
* the choice per request: lookup when it matches and is expected to keep at least the model's recent
  drafts, the model otherwise, lookup only for requests the draft gate skipped; the model drafter is
  asked only for its own rows; per-row draft probabilities (None = point mass for lookup rows);
* in the engine, on a tiny random Llama with a random-weight DSpark drafter: greedy parity under the
  fixed, prefix and async policies with arrivals and coalescing, both draft sources used in one run;
  the draft gate and online calibration learn from model rounds only; gate-skipped requests still
  verify lookup drafts; a sampled run mixes point-mass and model rows in one batch; prompts served a
  second time draft from the cross-request cache (its own acceptance class) with parity kept.

    pytest tests/test_lookup_first.py -q
"""

# ruff: noqa: F811  (the module-scoped fixtures of test_scheduled_verification are imported and reused)
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.config import SpecConfig
from dspark.drafters.base import DraftProposal, Drafter, ProposeBatch, ProposeRequest
from dspark.drafters.lookup_first import LookupAcceptance, LookupFirstDrafter
from dspark.drafters.ngram import CACHE, OWN, NgramCache, NgramDrafter
from dspark.sampling import SamplingParams
from tests.engine_helpers import greedy
from tests.scheduled_helpers import (  # noqa: F401  (fixtures)
    ARRIVAL_STEPS, COSTLY_DRAFTS, GAMMA, MAX_TOKENS, POLICIES, _mismatches, _prompts, _spec_engine,
    drafter_dir, plain_outputs, run_staged, target)


# -- the n-gram lookup against a brute-force twin --------------------------------------------------
def _lookup_brute_force(ids: list[int], *, min_n: int, max_n: int, width: int) -> tuple[list[int], int]:
    """Longest n in [min_n, max_n] whose last-n suffix occurs earlier; its most recent occurrence."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        for start in range(len(ids) - n - 1, -1, -1):  # windows that end before the last token
            if ids[start:start + n] == ids[-n:]:
                return ids[start + n:start + n + width], n
    return [], 0


def test_ngram_lookup_matches_brute_force():
    from dspark.drafters.ngram import NgramDrafter

    rng = np.random.default_rng(0)
    for min_n, max_n in [(1, 1), (2, 5), (3, 4), (1, 6)]:
        drafter = NgramDrafter(num_draft_tokens=7, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
        for _ in range(300):
            ids = rng.integers(0, int(rng.choice([2, 4, 16, 500])), size=int(rng.integers(1, 120))).tolist()
            assert drafter.lookup_with_length(ids) == _lookup_brute_force(
                ids, min_n=min_n, max_n=max_n, width=7), (min_n, max_n, ids)


# -- the acceptance counts -------------------------------------------------------------------------
def test_ngram_cache_longest_latest_and_bounded():
    cache = NgramCache(num_draft_tokens=3, min_n=3, max_n=4, max_entries=1000)
    cache.add([1, 2, 3, 4, 5, 6, 7])
    assert cache.lookup([9, 2, 3, 4]) == ([5, 6, 7], 3)  # 3-gram (2, 3, 4)
    assert cache.lookup([1, 2, 3, 4]) == ([5, 6, 7], 4)  # the 4-gram wins
    assert cache.lookup([9, 9, 2, 3]) == ([], 0)  # too short a match
    cache.add([8, 2, 3, 4, 0])  # a later occurrence replaces the continuation of (2, 3, 4)
    assert cache.lookup([9, 2, 3, 4]) == ([0], 3)
    assert cache.lookup([1, 2, 3, 4]) == ([5, 6, 7], 4)
    cache.add([7, 7, 7, 6, 5, 4, 3, 2], start=6)  # continuations from position 6 on: the prompt's own are not kept
    assert cache.lookup([7, 7, 7]) == ([], 0) and cache.lookup([6, 5, 4]) == ([3, 2], 3)
    small = NgramCache(num_draft_tokens=2, min_n=3, max_n=3, max_entries=4)
    small.add(list(range(10)))  # 7 trigrams with a continuation; the 4 latest are kept
    assert len(small) == 4 and small.lookup([2, 3, 4]) == ([], 0) and small.lookup([6, 7, 8]) == ([9], 3)
    with pytest.raises(ValueError):
        NgramCache(num_draft_tokens=2, min_n=4, max_n=3)


def test_cache_is_asked_only_where_the_own_context_has_no_match():
    drafter = NgramDrafter(num_draft_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3, cache_entries=100)
    drafter.observe_finished([5, 6, 7, 8, 9, 10], 3)
    assert drafter.lookup_with_source([1, 5, 6, 7]) == ([8, 9, 10], 3, CACHE)
    assert drafter.lookup_with_source([6, 7, 0, 6, 7]) == ([0, 6, 7], 2, OWN)  # own match first
    assert NgramDrafter(num_draft_tokens=3).lookup_with_source([1, 5, 6, 7]) == ([], 0, OWN)  # no cache


def test_lookup_acceptance_counts_conditional_acceptance():
    acc = LookupAcceptance(num_positions=4, max_match=3, prior=(1.0, 1.0), max_count=1000.0)
    assert acc.confidence(True, 2).tolist() == [0.5] * 4  # the prior
    acc.observe(True, 2, num_verified=4, num_accepted=2)  # positions 1, 2 accepted, 3 rejected, 4 unseen
    acc.observe(True, 2, num_verified=4, num_accepted=4)  # all accepted
    acc.observe(True, 2, num_verified=2, num_accepted=0)  # position 1 rejected
    # reached: [3, 2, 2, 1]; accepted: [2, 2, 1, 1]
    assert np.allclose(acc.confidence(True, 2), [(2 + 1) / (3 + 2), (2 + 1) / (2 + 2), (1 + 1) / (2 + 2),
                                                 (1 + 1) / (1 + 2)])
    assert acc.confidence(False, 2).tolist() == [0.5] * 4, "the sampling regime is counted apart"
    assert acc.confidence(True, 3).tolist() == [0.5] * 4, "each match length is counted apart"
    c = acc.confidence(True, 2)
    assert acc.expected_accepted(True, 2, 3) == pytest.approx(c[0] + c[0] * c[1] + c[0] * c[1] * c[2])


def test_lookup_acceptance_halves_at_the_cap():
    acc = LookupAcceptance(num_positions=2, max_match=2, prior=(0.0, 0.0), max_count=4.0)
    for _ in range(3):
        acc.observe(False, 2, num_verified=2, num_accepted=2)
    acc.observe(False, 2, num_verified=2, num_accepted=0)  # position 1 reaches 4 rounds: halved
    assert acc.reached[0, 2].tolist() == [2.0, 3.0] and acc.accepted[0, 2].tolist() == [1.5, 3.0]


# -- the choice per request --------------------------------------------------------------------------
class _FakeModel(Drafter):
    """Drafts token 7 everywhere with confidence `c`; records which requests it was asked for."""

    def __init__(self, c: float, *, probs: bool = False):
        self.num_draft_tokens, self.has_confidence, self.c, self.probs = 4, True, c, probs
        self.asked: list[list[str]] = []
        self.temperature_marker = "model"

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        n = len(batch.requests)
        self.asked.append([r.request_id for r in batch.requests])
        probs = torch.full((n, 4, 16), 1 / 16) if self.probs else None
        return DraftProposal(draft_ids=torch.full((n, 4), 7), draft_probs=probs,
                             confidence=torch.full((n, 4), self.c))


def _req(rid: str, ids: list[int], *, allow_model: bool = True, temperature: float = 0.0) -> ProposeRequest:
    return ProposeRequest(request_id=rid, all_ids=ids, anchor_pos=len(ids) - 1, block_table=[],
                          num_draft_computed=len(ids) - 1, generator=None, allow_model=allow_model,
                          params=SamplingParams(temperature=temperature, max_tokens=8))


REPEATING = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # suffix [1, 2, 3] recurs: lookup drafts [4, 5, 6, 1]
NO_MATCH = [9, 8, 10, 11]


def _batch(*reqs) -> ProposeBatch:
    return ProposeBatch(requests=list(reqs), kv_block_size=4, draft_sample_method="probabilistic")


def test_lookup_where_it_matches_model_elsewhere_and_only_for_its_rows():
    model = _FakeModel(0.9, probs=True)
    drafter = LookupFirstDrafter(model, prompt_lookup_min=2, prompt_lookup_max=3)
    assert drafter.temperature_marker == "model", "unknown attributes are the model drafter's"
    out = drafter.propose(_batch(_req("a", REPEATING), _req("b", NO_MATCH), _req("c", NO_MATCH, allow_model=False)))
    assert model.asked == [["b"]], "the model drafts only where the lookup found nothing and it is allowed"
    assert out.draft_ids[0].tolist() == [4, 5, 6, 1] and out.num_valid == [4, 4, 0]
    assert out.from_model == [False, True, False]
    assert out.draft_probs[0] is None and out.draft_probs[2] is None, "lookup rows are point masses"
    assert out.draft_probs[1].shape == (4, 16)
    assert torch.allclose(out.confidence[0], torch.tensor(drafter.acceptance.confidence(True, 3)).float())
    assert torch.allclose(out.confidence[1], torch.full((4,), 0.9))


def test_model_wins_when_lookup_keeps_fewer_and_gate_skipped_requests_get_lookup_only():
    model = _FakeModel(0.9)  # expected accepted 0.9 + 0.81 + 0.729 + 0.656 = 3.1
    drafter = LookupFirstDrafter(model, prompt_lookup_min=2, prompt_lookup_max=3)
    drafter.propose(_batch(_req("warm", NO_MATCH)))  # the model's running expectation exists now
    for _ in range(20):  # lookup drafts of match length 3 keep one token in four
        drafter.acceptance.observe(True, 3, num_verified=4, num_accepted=0)
    out = drafter.propose(_batch(_req("a", REPEATING), _req("b", REPEATING, allow_model=False)))
    assert model.asked[-1] == ["a"], "the model keeps more: it drafts for 'a'"
    assert out.from_model == [True, False] and out.draft_ids[1].tolist() == [4, 5, 6, 1]
    # the verification outcome of a lookup row feeds the counts; a model row's does not
    before = drafter.acceptance.reached.copy()
    drafter.observe_verify("a", out.confidence[0].tolist(), 4, 4)
    assert np.array_equal(before, drafter.acceptance.reached)
    drafter.observe_verify("b", out.confidence[1].tolist(), 4, 4)
    assert drafter.acceptance.reached[1, 3, 0] == before[1, 3, 0] + 1
    # a sampling request is judged against the sampling regime's model record (none yet): lookup
    out = drafter.propose(_batch(_req("s", REPEATING, temperature=1.0)))
    assert out.from_model == [False]


def test_ngram_first_config():
    with pytest.raises(ValueError, match="ngram_first"):
        SpecConfig(method="ngram", ngram_first=True)


# -- in the engine ---------------------------------------------------------------------------------
def _lookup_engine(target, drafter_dir, policy_name, *, cost=None, **kw):
    """The tiny engine with "ngram_first": true (build_drafter wraps the DSpark drafter)."""
    make_policy, default_cost = POLICIES[policy_name]
    engine = _spec_engine(target, drafter_dir, make_policy(), cost=cost or default_cost, coalesce_steps=2,
                          ngram_first=True, **kw)
    assert isinstance(engine.drafter, LookupFirstDrafter)
    assert engine.drafter.observe_verify in engine.spec.verify_observers, "Engine wires the lookup counts"
    return engine


@pytest.mark.parametrize("policy", ["fixedG", "prefix", "async"])
def test_greedy_parity_with_both_sources(target, drafter_dir, plain_outputs, policy):
    engine = _lookup_engine(target, drafter_dir, policy)
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0, policy
    drafter = engine.drafter
    assert engine.metrics.num_lookup_drafts > 0, "the lookup must draft"
    assert drafter.model_expected[True] is not None, "the model must draft (its running record exists)"
    assert drafter.acceptance.reached.sum() > 0, "lookup outcomes must be counted"
    bm = engine.block_manager
    assert bm.num_free_blocks == len(bm.blocks)


def test_second_serving_drafts_from_the_cross_request_cache(target, drafter_dir, plain_outputs):
    """The prompts served again (new requests) find their earlier answers in the cache: cache-class
    lookup rounds are verified and accepted, and the outputs stay the plain ones."""
    engine = _lookup_engine(target, drafter_dir, "fixedG")
    drafter = engine.drafter
    first = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert len(drafter.lookup.cache) > 0, "finished requests must enter the cache"
    cache_rows = np.s_[:, drafter.cache_class + 1:, 0]  # rounds counted per cache match class
    before = drafter.acceptance.reached[cache_rows].sum(), drafter.acceptance.accepted[cache_rows].sum()
    again = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    reached = drafter.acceptance.reached[cache_rows].sum() - before[0]
    accepted = drafter.acceptance.accepted[cache_rows].sum() - before[1]
    assert _mismatches(first.outputs, plain_outputs) == 0 and _mismatches(again.outputs, plain_outputs) == 0
    assert reached > 0 and accepted / reached > 0.8, (reached, accepted)
    off = _lookup_engine(target, drafter_dir, "fixedG", lookup_cache_entries=0)
    run_staged(off, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert off.drafter.lookup.cache is None and off.drafter.acceptance.reached[cache_rows].sum() == 0


def test_model_observers_see_model_rounds_only_and_skipped_requests_verify_lookups(target, drafter_dir,
                                                                                    plain_outputs):
    engine = _lookup_engine(target, drafter_dir, "prefix", cost=COSTLY_DRAFTS)  # the gate skips the model
    seen = {"model": [], "all": []}
    from_model = {}  # request_id → the source of the drafts its window in this step carries
    schedule = engine.scheduler.schedule

    def recording():
        sched = schedule()
        from_model.clear()
        from_model.update((s.request.request_id, s.drafts.from_model) for s in sched.scheduled)
        return sched
    engine.scheduler.schedule = recording
    engine.spec.model_verify_observers.append(
        lambda rid, conf, n, k: seen["model"].append(from_model[rid]) if n else None)
    engine.spec.verify_observers.append(
        lambda rid, conf, n, k: seen["all"].append(from_model[rid]) if n else None)
    staged = run_staged(engine, _prompts(), greedy(MAX_TOKENS), ARRIVAL_STEPS)
    assert _mismatches(staged.outputs, plain_outputs) == 0
    assert engine.metrics.num_draft_skips > 0, "the gate must skip the costly model drafts"
    assert False in seen["all"], "lookup drafts must be verified (skipped requests included)"
    assert seen["model"] and all(seen["model"]), "the gate and the upkeep must see model rounds only"
    assert seen["model"].count(True) == seen["all"].count(True)


def test_build_drafter_wraps_and_a_sampled_batch_mixes_sources(target, drafter_dir):
    # prompt_lookup_min=1 and T=0.5: sampled continuations stay close enough to the prompts' motifs
    # that the lookup matches in some steps and not in others
    engine = _lookup_engine(target, drafter_dir, "fixedG", draft_sample_method="probabilistic",
                            prompt_lookup_min=1)
    drafter = engine.drafter
    assert drafter.has_confidence and drafter.tap_layer_ids == drafter.model_drafter.tap_layer_ids
    rows = []
    propose = engine.spec._propose_and_choose

    def recorded(reqs, allowed, num_nondraft):
        drafts, n = propose(reqs, allowed, num_nondraft)
        rows.append([(d.from_model, d.probs is None) for d in drafts.values() if d.ids])
        return drafts, n
    engine.spec._propose_and_choose = recorded
    params = SamplingParams(temperature=0.5, max_tokens=MAX_TOKENS, ignore_eos=True, seed=5)
    staged = run_staged(engine, _prompts(), params, ARRIVAL_STEPS)
    assert all(len(o) == MAX_TOKENS for o in staged.outputs)
    mixed = [step for step in rows if {m for m, _ in step} == {True, False}]
    assert mixed, "no step held lookup and model rows together"
    for step in mixed:
        assert all(is_point_mass == (not from_model) for from_model, is_point_mass in step)
