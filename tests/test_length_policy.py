"""Tests for dspark/speculation/length_policy.py: hand-worked Algorithm 1 traces, the paper's Appendix A
counterexample as a Monte-Carlo check (with the break: lossless; without: detectably biased), cost
curve monotonicity, the async scheduler's two-step causal barrier, and fail-closed construction.

    pytest tests/test_length_policy.py -q
"""

from __future__ import annotations

import pytest
import torch

from dspark.speculation.cost_table import CostTable
from dspark.speculation.length_policy import (
    LENGTH_POLICIES,
    AsyncPrefixScheduler,
    ConfidenceThreshold,
    FixedLength,
    PrefixScheduler,
    build_length_policy,
)
from dspark.verify.rejection import rejection_sample_batched
from stat_checks import assert_differs_from_distribution, assert_matches_distribution


def _choose(policy, confidence, *, num_nondraft_tokens, cost, num_proposed=None):
    confidence = torch.tensor(confidence, dtype=torch.float64)
    return policy.choose(confidence=confidence, num_draft_tokens=confidence.shape[1],
                         num_nondraft_tokens=num_nondraft_tokens, cost=cost,
                         num_proposed=num_proposed)


# Two requests, γ = 3. Survivals: r0: 0.9, 0.72, 0.36; r1: 0.6, 0.3, 0.27.
# Ranked: (r0,1) .9, (r0,2) .72, (r1,1) .6, (r0,3) .36, (r1,2) .3, (r1,3) .27.
TRACE_CONFIDENCE = [[0.9, 0.8, 0.5], [0.6, 0.5, 0.9]]


def _trace_table(sps_at_8: float) -> CostTable:
    return CostTable(num_tokens=[2, 3, 4, 5, 6, 7, 8],
                     steps_per_second=[10.0, 9.5, 9.0, 8.0, 6.0, 5.0, sps_at_8])


def test_algorithm_1_trace_stops_at_first_drop():
    # Θ0 = 2·10 = 20; Θ1 = 2.9·9.5 = 27.55; Θ2 = 3.62·9 = 32.58; Θ3 = 4.22·8 = 33.76;
    # Θ4 = 4.58·6 = 27.48 < 33.76 -> break. Admitted: (r0,1), (r0,2), (r1,1).
    lengths = _choose(PrefixScheduler(), TRACE_CONFIDENCE, num_nondraft_tokens=2,
                      cost=_trace_table(4.5))
    assert lengths == [2, 1]


def test_algorithm_1_trace_break_ignores_later_recovery():
    # A jagged curve: SPS(8) = 8 makes Θ6 = 5.15·8 = 41.2 the global maximum. With the break the
    # scheduler never looks past Θ4; without it, it takes every candidate.
    table = _trace_table(8.0)
    assert _choose(PrefixScheduler(), TRACE_CONFIDENCE, num_nondraft_tokens=2, cost=table) == [2, 1]
    assert _choose(PrefixScheduler(break_on_drop=False), TRACE_CONFIDENCE, num_nondraft_tokens=2,
                   cost=table) == [3, 3]


def test_algorithm_1_admits_nothing_when_first_candidate_lowers_throughput():
    table = CostTable(num_tokens=[1, 2], steps_per_second=[1.0, 0.5])
    # Θ0 = 1·1 = 1; Θ1 = 1.9·0.5 = 0.95 -> nothing admitted, even a 0.9-confident draft.
    assert _choose(PrefixScheduler(), [[0.9, 0.9]], num_nondraft_tokens=1, cost=table) == [0]


def test_prefix_scheduler_uses_draft_seconds_and_nondraft_tokens():
    # Draft cost is paid whatever is admitted, so it dilutes the verify-cost increase:
    # steps of 1 s at 3 tokens, 1.5 s at 4 tokens. Without draft cost: Θ0 = 1/1, Θ1 = 1.4/1.5 < Θ0.
    # With 2 s draft: Θ0 = 1/3, Θ1 = 1.4/3.5 = 0.4 > 0.333 -> admitted.
    verify_only = CostTable(num_tokens=[3, 4], steps_per_second=[1.0, 1 / 1.5])
    with_draft = CostTable(num_tokens=[3, 4], steps_per_second=[1.0, 1 / 1.5],
                           draft_num_reqs=[1], draft_seconds=[2.0])
    # num_nondraft_tokens = 3: one decoding request plus a 2-token prefill chunk.
    assert _choose(PrefixScheduler(), [[0.4]], num_nondraft_tokens=3, cost=verify_only) == [0]
    assert _choose(PrefixScheduler(), [[0.4]], num_nondraft_tokens=3, cost=with_draft) == [1]


def test_prompt_chunk_time_is_charged_to_the_prompt():
    # T(B) = 10 ms + 1 ms per token. Two decoding requests + a 100-token prompt chunk, one draft of
    # survival 0.1 each. Charging the chunk's time to the output (old rule): Θ0 = 2 / 112 ms, and a draft
    # adding 1 ms for 0.1 tokens raises it (0.1 / 1 > 2 / 112). Charged to the prompt: Θ0 = 2 / 12 ms and
    # the draft lowers it (0.1 / 1 < 2 / 12): the same decision as a step without the chunk.
    sizes = list(range(1, 200))
    linear = CostTable(num_tokens=sizes, steps_per_second=[1.0 / (0.010 + 0.001 * b) for b in sizes])
    confidence = [[0.1], [0.1]]
    assert _choose(PrefixScheduler(), confidence, num_nondraft_tokens=102, cost=linear) == [1, 1]
    charged = PrefixScheduler().choose(confidence=torch.tensor(confidence), num_draft_tokens=1,
                                       num_nondraft_tokens=102, num_prompt_tokens=100, cost=linear)
    assert charged == [0, 0] == _choose(PrefixScheduler(), confidence, num_nondraft_tokens=2, cost=linear)
    # a draft that pays without the chunk still pays beside it (survival 0.9: 0.9 / 1 > 2 / 12)
    assert PrefixScheduler().choose(confidence=torch.tensor([[0.9], [0.9]]), num_draft_tokens=1,
                                    num_nondraft_tokens=102, num_prompt_tokens=100, cost=linear) == [1, 1]
    # the async capacity and the draft gate price the chunk the same way
    policy = AsyncPrefixScheduler()
    for _ in range(2):
        policy.observe(torch.tensor(confidence))
    assert policy.capacity(cost=linear, num_reqs=2, num_nondraft_tokens=102) == 2
    assert policy.capacity(cost=linear, num_reqs=2, num_nondraft_tokens=102, num_prompt_tokens=100) == 0
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        PrefixScheduler().choose(confidence=torch.tensor(confidence), num_draft_tokens=1,
                                 num_nondraft_tokens=2, num_prompt_tokens=3, cost=linear)


def test_draft_seconds_count_only_for_requests_the_drafter_ran_for():
    # As in test_prefix_scheduler_uses_draft_seconds_and_nondraft_tokens: a 2 s draft dilutes the verify
    # cost so the 0.4 draft is admitted; prompt-lookup rows (num_drafted_reqs=0) cost no draft time.
    with_draft = CostTable(num_tokens=[3, 4], steps_per_second=[1.0, 1 / 1.5],
                           draft_num_reqs=[1], draft_seconds=[2.0])
    kwargs = dict(confidence=torch.tensor([[0.4]]), num_draft_tokens=1, num_nondraft_tokens=3, cost=with_draft)
    assert PrefixScheduler().choose(**kwargs) == [1]
    assert PrefixScheduler().choose(**kwargs, num_drafted_reqs=1) == [1]
    assert PrefixScheduler().choose(**kwargs, num_drafted_reqs=0) == [0]


def test_max_drafts_caps_the_ranked_admission():
    # FLAT: every positive survival pays; a cap of 3 keeps the 3 best candidates, a prefix per request
    flat = CostTable(num_tokens=[1, 1000], steps_per_second=[7.0, 7.0])
    kwargs = dict(confidence=torch.tensor(TRACE_CONFIDENCE), num_draft_tokens=3, num_nondraft_tokens=2, cost=flat)
    assert PrefixScheduler().choose(**kwargs) == [3, 3]
    assert PrefixScheduler().choose(**kwargs, max_drafts=3) == [2, 1]  # (r0,1) .9, (r0,2) .72, (r1,1) .6
    assert PrefixScheduler().choose(**kwargs, max_drafts=0) == [0, 0]
    policy = AsyncPrefixScheduler()
    for _ in range(2):
        policy.observe(torch.tensor(TRACE_CONFIDENCE))
    assert policy.choose(**kwargs) == [3, 3] and policy.choose(**kwargs, max_drafts=3) == [2, 1]


def test_flat_cost_curve_admits_every_positive_survival():
    generator = torch.Generator().manual_seed(0)
    confidence = torch.rand(6, 5, generator=generator, dtype=torch.float64)
    confidence[confidence < 0.2] = 0.0  # zero confidence ends a request's candidates
    flat = CostTable(num_tokens=[1, 1000], steps_per_second=[7.0, 7.0])
    lengths = PrefixScheduler().choose(confidence=confidence, num_draft_tokens=5,
                                       num_nondraft_tokens=6, cost=flat)
    expected = (confidence.cumprod(dim=1) > 0).sum(dim=1).tolist()
    assert lengths == expected
    limited = PrefixScheduler().choose(confidence=confidence, num_draft_tokens=5,
                                       num_nondraft_tokens=6, cost=flat, num_proposed=[2] * 6)
    assert limited == [min(n, 2) for n in expected]


@pytest.mark.parametrize("break_on_drop", [True, False])
def test_steeper_cost_curve_never_admits_more(break_on_drop: bool):
    # SPS_α(B) = B^-α: a larger α has a smaller SPS(B+1)/SPS(B) at every B.
    sizes = list(range(1, 200))
    tables = [CostTable(num_tokens=sizes, steps_per_second=[b ** -alpha for b in sizes])
              for alpha in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0)]
    generator = torch.Generator().manual_seed(1)
    policy = PrefixScheduler(break_on_drop=break_on_drop)
    for _ in range(50):
        confidence = torch.rand(8, 7, generator=generator, dtype=torch.float64) ** 0.3
        totals = [sum(policy.choose(confidence=confidence, num_draft_tokens=7,
                                    num_nondraft_tokens=8, cost=table)) for table in tables]
        assert totals == sorted(totals, reverse=True), totals


def test_admission_is_a_prefix_with_tied_survivals():
    # c = 1 makes a_{r,j+1} == a_{r,j}; ties must still admit j before j + 1.
    table = CostTable(num_tokens=[2, 3, 4], steps_per_second=[10.0, 9.9, 1.0])
    assert _choose(PrefixScheduler(), [[0.5, 1.0], [0.5, 1.0]], num_nondraft_tokens=2,
                   cost=table) == [1, 0]


# --------------------------------------------------------------------------------------------------
# Appendix A: R = 1, γ = 2, vocab {A, B}; target (0.7, 0.3), draft (0.5, 0.5); c_1 = 0.8 and
# c_2 = 0.9 if x_1 = A else 0; SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45.

APPENDIX_A_COST = CostTable(num_tokens=[1, 2, 3], steps_per_second=[1.0, 0.5, 0.45])
TARGET = torch.tensor([0.7, 0.3], dtype=torch.float32)
DRAFT = torch.tensor([0.5, 0.5], dtype=torch.float32)
SECOND_CONFIDENCE = {0: 0.9, 1: 0.0}  # the toy drafter's c_2 as a function of the sampled x_1
NUM_TRIALS = 100_000


def _appendix_a_first_tokens(policy, generator: torch.Generator) -> torch.Tensor:
    """One speculative step per trial: draft x1, x2 ~ DRAFT; the policy sees (c_1, c_2(x_1)); the
    target verifies the chosen prefix. Returns the first emitted token of each trial."""
    draft_ids = torch.multinomial(DRAFT, 2 * NUM_TRIALS, replacement=True,
                                  generator=generator).view(NUM_TRIALS, 2)
    verify_len_for = {}  # the policy's decision is a deterministic function of x_1
    for x1, c2 in SECOND_CONFIDENCE.items():
        [verify_len_for[x1]] = policy.choose(confidence=torch.tensor([[0.8, c2]]),
                                             num_draft_tokens=2, num_nondraft_tokens=1,
                                             cost=APPENDIX_A_COST)
    verify_lens = torch.tensor([verify_len_for[int(x)] for x in (0, 1)])[draft_ids[:, 0]]
    first_tokens = torch.empty(NUM_TRIALS, dtype=torch.long)
    for verify_len in verify_lens.unique().tolist():
        rows = verify_lens == verify_len
        num_rows = int(rows.sum())
        # Later target rows do not matter for the first token; any distribution works.
        target_probs = TARGET.expand(num_rows, verify_len + 1, 2)
        drafts = draft_ids[rows, :verify_len]
        num_accepted, final_ids = rejection_sample_batched(
            target_probs=target_probs, draft_ids=drafts,
            draft_probs=DRAFT.expand(num_rows, verify_len, 2), generator=generator)
        first_tokens[rows] = final_ids if verify_len == 0 else torch.where(
            num_accepted > 0, drafts[:, 0], final_ids)
    return first_tokens


def test_appendix_a_decisions():
    with_break, without_break = PrefixScheduler(), PrefixScheduler(break_on_drop=False)
    for x1, c2 in SECOND_CONFIDENCE.items():
        choose = dict(confidence=torch.tensor([[0.8, c2]]), num_draft_tokens=2,
                      num_nondraft_tokens=1, cost=APPENDIX_A_COST)
        assert with_break.choose(**choose) == [0]  # Θ1 = 0.9 < Θ0 = 1.0: stop before x_1's effect
        assert without_break.choose(**choose) == [2 if x1 == 0 else 0]  # Θ2 = 1.134 only after A


def test_appendix_a_with_break_is_lossless():
    first_tokens = _appendix_a_first_tokens(PrefixScheduler(), torch.Generator().manual_seed(5))
    assert_matches_distribution(first_tokens, TARGET, what="Appendix A, with break")


def test_appendix_a_without_break_is_biased():
    # Expected output A w.p. 0.5·1 + 0.5·0.7 = 0.85 instead of 0.7.
    first_tokens = _appendix_a_first_tokens(PrefixScheduler(break_on_drop=False),
                                            torch.Generator().manual_seed(5))
    assert abs(float((first_tokens == 0).double().mean()) - 0.85) < 0.01  # ~6.7 sigma at 10^5
    assert_differs_from_distribution(first_tokens, TARGET, what="Appendix A, without break")


@pytest.mark.parametrize("stale_confidence", [[[0.8, 0.9]], [[0.99, 0.99]], [[0.01, 0.01]]])
def test_appendix_a_async_is_lossless(stale_confidence):
    # Whatever the capacity (from stale data), current ranking cannot make x_1's admission depend
    # on x_1: the causal barrier of reference §6.3.
    policy = AsyncPrefixScheduler()
    for _ in range(2):
        policy.observe(torch.tensor(stale_confidence))
    first_tokens = _appendix_a_first_tokens(policy, torch.Generator().manual_seed(6))
    assert_matches_distribution(first_tokens, TARGET, what=f"async, stale {stale_confidence}")


# --------------------------------------------------------------------------------------------------
# Async scheduler


def test_async_capacity_comes_from_two_steps_prior():
    cost = CostTable(num_tokens=list(range(1, 40)),
                     steps_per_second=[1.0 / (1.0 + 0.1 * b) for b in range(1, 40)])
    policy = AsyncPrefixScheduler(cold_start_len=1)
    generator = torch.Generator().manual_seed(7)
    steps = [torch.rand(4, 5, generator=generator, dtype=torch.float64) for _ in range(6)]

    def choose(current):
        return policy.choose(confidence=current, num_draft_tokens=5, num_nondraft_tokens=4,
                             cost=cost)

    assert choose(steps[0]) == [1, 1, 1, 1]  # cold start: nothing observed
    policy.observe(steps[0])
    assert choose(steps[1]) == [1, 1, 1, 1]  # one observation is still a cold start
    policy.observe(steps[1])
    for t in range(2, 6):
        expected_capacity = PrefixScheduler(break_on_drop=False).choose(
            confidence=steps[t - 2], num_draft_tokens=5, num_nondraft_tokens=4, cost=cost)
        # The current step's confidences only rank: very different current values, same total.
        for current in (steps[t], torch.ones(4, 5, dtype=torch.float64),
                        torch.full((4, 5), 0.01, dtype=torch.float64)):
            assert sum(choose(current)) == sum(expected_capacity)
        policy.observe(steps[t])


def test_async_ranks_current_survival():
    cost = CostTable(num_tokens=[1, 100], steps_per_second=[1.0, 1.0])  # flat: capacity = all stale
    policy = AsyncPrefixScheduler()
    policy.observe(torch.tensor([[0.5, 0.5, 0.0]]))  # two positive survivals -> capacity 2
    policy.observe(torch.tensor([[1.0, 1.0, 1.0]]))  # ignored this step
    assert policy.capacity(cost=cost, num_reqs=2, num_nondraft_tokens=2) == 2
    lengths = policy.choose(confidence=torch.tensor([[0.9, 0.9, 0.9], [0.5, 0.5, 0.5]]),
                            num_draft_tokens=3, num_nondraft_tokens=2, cost=cost)
    assert lengths == [2, 0]  # 0.9, 0.81 beat 0.5


# --------------------------------------------------------------------------------------------------
# Fixed / threshold, registry, fail-closed


def test_fixed_length():
    assert FixedLength(3).choose(confidence=None, num_draft_tokens=5, num_nondraft_tokens=2,
                                 cost=None, num_reqs=2) == [3, 3]
    assert FixedLength(9).choose(confidence=None, num_draft_tokens=5, num_nondraft_tokens=2,
                                 cost=None, num_proposed=[2, 7]) == [2, 5]
    assert FixedLength(0).choose(confidence=torch.ones(3, 4), num_draft_tokens=4,
                                 num_nondraft_tokens=3, cost=None) == [0, 0, 0]
    with pytest.raises(ValueError, match="num_reqs"):
        FixedLength(1).choose(confidence=None, num_draft_tokens=5, num_nondraft_tokens=2, cost=None)
    with pytest.raises(ValueError, match="verify_len"):
        FixedLength(-1)


def test_confidence_threshold():
    confidence = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 1.0, 1.0, 1.0], [0.95, 0.2, 0.99, 0.99]])
    # survival: [.9 .81 .729 .656], [.5 .5 .5 .5], [.95 .19 .188 .186]
    kwargs = dict(num_draft_tokens=4, num_nondraft_tokens=3, cost=None)
    assert ConfidenceThreshold(0.7).choose(confidence=confidence, **kwargs) == [3, 0, 1]
    assert ConfidenceThreshold(0.0).choose(confidence=confidence, **kwargs) == [4, 4, 4]
    assert ConfidenceThreshold(0.0).choose(confidence=confidence, num_proposed=[1, 2, 3],
                                           **kwargs) == [1, 2, 3]
    conditional = ConfidenceThreshold(0.7, cumulative=False)
    assert conditional.choose(confidence=confidence, **kwargs) == [4, 0, 1]


@pytest.mark.parametrize("policy", [ConfidenceThreshold(0.5), PrefixScheduler(),
                                    AsyncPrefixScheduler()])
def test_missing_confidence_fails_closed(policy):
    with pytest.raises(ValueError, match="needs draft confidences"):
        policy.choose(confidence=None, num_draft_tokens=3, num_nondraft_tokens=1,
                      cost=APPENDIX_A_COST, num_reqs=1)


@pytest.mark.parametrize("policy", [PrefixScheduler(), AsyncPrefixScheduler()])
def test_missing_cost_fails_closed(policy):
    with pytest.raises(ValueError, match="needs a cost table"):
        policy.choose(confidence=torch.ones(1, 3), num_draft_tokens=3, num_nondraft_tokens=1,
                      cost=None)


def test_nan_confidence_fails_closed():
    with pytest.raises(ValueError, match="NaN"):
        PrefixScheduler().choose(confidence=torch.tensor([[float("nan")]]), num_draft_tokens=1,
                                 num_nondraft_tokens=1, cost=APPENDIX_A_COST)


def test_registry_and_build():
    assert set(LENGTH_POLICIES) == {"fixed", "threshold", "prefix", "async"}
    assert build_length_policy("fixed", verify_len=4) == FixedLength(4)
    assert build_length_policy("prefix", break_on_drop=True) == PrefixScheduler()
    assert isinstance(build_length_policy("async", cold_start_len=2), AsyncPrefixScheduler)
    with pytest.raises(ValueError, match="known: \\['async', 'fixed', 'prefix', 'threshold'\\]"):
        build_length_policy("nope")
    with pytest.raises(ValueError, match="needs draft confidences"):
        build_length_policy("threshold", confidence_available=False, threshold=0.5)
    with pytest.raises(ValueError, match="needs a cost table"):
        build_length_policy("prefix", cost_available=False)
    assert build_length_policy("fixed", confidence_available=False, cost_available=False,
                               verify_len=2) == FixedLength(2)


def test_threshold_rule_named_in_the_config_and_deepspec_rule_matches_a_loop():
    from types import SimpleNamespace

    from dspark.config import EngineConfig, SpecConfig
    from dspark.engine.build import build_policy
    drafter = SimpleNamespace(has_confidence=True)
    for rule, cumulative in (("cumulative", True), ("conditional", False)):
        spec = SpecConfig(method="dspark", model="x", length_policy="threshold", confidence_threshold=0.6,
                          threshold_rule=rule)
        policy, _ = build_policy(EngineConfig(spec=spec), drafter)
        assert isinstance(policy, ConfidenceThreshold) and policy.cumulative is cumulative and policy.threshold == 0.6
    with pytest.raises(ValueError, match="threshold_rule 'first' unknown"):
        SpecConfig(method="dspark", model="x", length_policy="threshold", threshold_rule="first")
    with pytest.raises(ValueError, match="applies to length_policy 'threshold'"):
        SpecConfig(method="dspark", model="x", threshold_rule="conditional")
    # DeepSpec's rule, the slow way: walk the positions, stop at the first confidence below the threshold
    g = torch.Generator().manual_seed(0)
    confidence = torch.rand(64, 6, generator=g)
    for t in (0.2, 0.5, 0.8):
        expect = []
        for row in confidence.tolist():
            n = 0
            while n < len(row) and row[n] >= t:
                n += 1
            expect.append(n)
        got = ConfidenceThreshold(t, cumulative=False).choose(confidence=confidence, num_draft_tokens=6,
                                                              num_nondraft_tokens=64, cost=None)
        assert got == expect
