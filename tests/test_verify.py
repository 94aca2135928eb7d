"""Tests for dspark/verify/rejection.py: exact greedy cases, and Monte-Carlo checks (10^5 trials,
chi-square at odds 1e-6) that rejection sampling reproduces the target distribution — including a
deliberately wrong verifier that the same check must reject.

    pytest tests/test_verify.py -q
"""

from __future__ import annotations

import pytest
import torch

from dspark.verify.rejection import VerifyResult, rejection_sample_batched, verify_greedy_argmax
from verify_reference import verify, verify_greedy, verify_rejection
from stat_checks import (
    assert_differs_from_distribution,
    assert_matches_distribution,
    chi_square_sf,
    chi_square_statistic,
)

VOCAB_SIZE = 5
NUM_TRIALS = 100_000
TARGET_FIRST = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])  # [vocab_size]
DRAFT_FIRST = torch.tensor([0.10, 0.15, 0.30, 0.30, 0.15])  # [vocab_size], deliberately far off


def _one_hot_rows(ids: list[int], vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    # [len(ids), vocab_size]
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab_size).float()


def _random_conditional(generator: torch.Generator, *leading: int) -> torch.Tensor:
    """Random distributions over the vocab for every prefix: [*leading, vocab_size]."""
    return torch.softmax(2.0 * torch.randn(*leading, VOCAB_SIZE, generator=generator), dim=-1)


# --------------------------------------------------------------------------------------------------
# Exact-token cases


def test_greedy_all_accepted_gives_bonus():
    result = verify_greedy(target_probs=[_one_hot_rows([3, 1, 4])], draft_ids=[[3, 1]])
    assert result == VerifyResult(num_accepted=[2], output_ids=[[3, 1, 4]], is_bonus=[True])
    assert result.num_emitted == [3]


def test_greedy_first_mismatch_gives_recovered_argmax():
    result = verify_greedy(target_probs=[_one_hot_rows([3, 1, 4, 0])], draft_ids=[[3, 2, 4]])
    assert result == VerifyResult(num_accepted=[1], output_ids=[[3, 1]], is_bonus=[False])


def test_greedy_rejects_at_position_zero_and_empty_drafts():
    result = verify_greedy(target_probs=[_one_hot_rows([2, 2]), _one_hot_rows([4])],
                           draft_ids=[[0], []])
    assert result.num_accepted == [0, 0]
    assert result.output_ids == [[2], [4]]
    assert result.is_bonus == [False, True]  # no drafts: the single token counts as the bonus


def test_greedy_uses_argmax_of_soft_rows():
    target_probs = torch.tensor([[0.1, 0.6, 0.3, 0.0, 0.0], [0.5, 0.2, 0.1, 0.1, 0.1]])
    result = verify_greedy(target_probs=[target_probs], draft_ids=[[1]])
    assert result.output_ids == [[1, 0]]


def test_argmax_lane_matches_one_hot_verification():
    """The engine's all-greedy lane (argmax ids) against `verify` over the one-hot distributions the
    sampling path builds from the same logits, on random windows that accept 0..γ drafts."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        num_reqs = int(torch.randint(1, 5, (1,), generator=gen))
        logits = [torch.randn(int(torch.randint(1, 6, (1,), generator=gen)), VOCAB_SIZE, generator=gen)
                  for _ in range(num_reqs)]
        argmax = [row.argmax(-1).tolist() for row in logits]
        # drafts that follow the argmax for a random prefix, then (maybe) diverge
        drafts = [[t if torch.rand(1, generator=gen) < 0.7 else (t + 1) % VOCAB_SIZE for t in ids[:-1]] for ids in argmax]
        fast = verify_greedy_argmax(target_argmax=argmax, draft_ids=drafts)
        slow = verify_greedy(target_probs=[_one_hot_rows(ids) for ids in argmax], draft_ids=drafts)
        assert fast == slow
    with pytest.raises(ValueError, match="verify_len"):
        verify_greedy_argmax(target_argmax=[[1, 2]], draft_ids=[[1, 2]])


def test_mixed_batch_routes_per_request():
    generator = torch.Generator().manual_seed(0)
    sampled_target = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    result = verify(
        target_probs=[_one_hot_rows([1, 2]), sampled_target, _one_hot_rows([0])],
        draft_ids=[[1], [2], []],
        draft_probs=[None, _one_hot_rows([2]), None],
        is_greedy=[True, False, True],
        generators=[None, generator, None],
    )
    # Request 1: target puts all mass on the draft, so it is accepted surely; bonus is token 4.
    assert result.output_ids == [[1, 2], [2, 4], [0]]
    assert result.num_accepted == [1, 1, 0]
    assert result.is_bonus == [True, True, True]


def test_rejection_point_mass_is_exact_for_certain_outcomes():
    target_probs = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5, 0.0]])
    generator = torch.Generator().manual_seed(1)
    result = verify_rejection(target_probs=[target_probs], draft_ids=[[3]], draft_probs=[None],
                              generators=[generator])
    # target(3) = 0: rejected surely; recovered from the target with token 3 zeroed -> token 1.
    assert result == VerifyResult(num_accepted=[0], output_ids=[[1]], is_bonus=[False])


def test_extra_draft_prob_rows_are_ignored_and_shapes_are_checked():
    generator = torch.Generator().manual_seed(2)
    draft_probs = _random_conditional(generator, 4)  # [4, vocab_size]: drafter proposed 4, verify 2
    target_probs = _one_hot_rows([0, 1, 2])
    result = verify_rejection(target_probs=[target_probs], draft_ids=[[0, 1]],
                              draft_probs=[draft_probs], generators=[generator])
    assert result.output_ids == [[0, 1, 2]]
    with pytest.raises(ValueError, match="target_probs must be"):
        verify_greedy(target_probs=[target_probs], draft_ids=[[0]])
    with pytest.raises(ValueError, match="generators has 0 entries"):
        verify(target_probs=[target_probs], draft_ids=[[0, 1]], draft_probs=[None],
               is_greedy=[False], generators=[])


def test_seeded_generators_are_deterministic():
    def run(seed: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        setup = torch.Generator().manual_seed(123)
        outputs = []
        for _ in range(50):
            target_probs = _random_conditional(setup, 4)
            draft_probs = _random_conditional(setup, 3)
            draft_ids = torch.multinomial(draft_probs, 1, generator=setup).squeeze(1).tolist()
            result = verify_rejection(target_probs=[target_probs], draft_ids=[draft_ids],
                                      draft_probs=[draft_probs], generators=[generator])
            outputs.append(result.output_ids[0])
        return outputs

    assert run(7) == run(7)
    assert run(7) != run(8)  # 50 random rounds agreeing under two seeds: odds far below 1e-6


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_one_hot_target_reproduces_greedy(with_draft_probs: bool):
    setup = torch.Generator().manual_seed(3)
    generator = torch.Generator().manual_seed(4)
    for _ in range(200):
        verify_len = int(torch.randint(0, 5, (1,), generator=setup))
        target_ids = torch.randint(0, VOCAB_SIZE, (verify_len + 1,), generator=setup)
        draft_ids = target_ids[:verify_len].clone()
        flip = torch.rand(verify_len, generator=setup) < 0.3
        draft_ids[flip] = torch.randint(0, VOCAB_SIZE, (int(flip.sum()),), generator=setup)
        target_probs = _one_hot_rows(target_ids.tolist())
        draft_probs = _random_conditional(setup, verify_len) if with_draft_probs else None
        greedy = verify_greedy(target_probs=[target_probs], draft_ids=[draft_ids.tolist()])
        sampled = verify_rejection(target_probs=[target_probs], draft_ids=[draft_ids.tolist()],
                                   draft_probs=[draft_probs], generators=[generator])
        assert sampled == greedy


# --------------------------------------------------------------------------------------------------
# Monte-Carlo: the first emitted token, and the joint of two positions, follow the target.


def test_chi_square_helper_against_table_values():
    # Textbook 5 % critical values for dof 1, 2, 4, 10, 24; 1e-6 at dof 1 is 23.93.
    for statistic, dof in [(3.841, 1), (5.991, 2), (9.488, 4), (18.307, 10), (36.415, 24)]:
        assert chi_square_sf(statistic, dof) == pytest.approx(0.05, rel=1e-3)
    assert chi_square_sf(23.93, 1) == pytest.approx(1e-6, rel=1e-2)
    # Pooling: the two small cells (expected 2 and 1) are merged into the smallest other cell.
    stat, dof = chi_square_statistic(torch.tensor([0] * 50 + [1] * 47 + [2] * 3),
                                     torch.tensor([0.5, 0.47, 0.02, 0.01]))
    assert dof == 1 and stat == pytest.approx(0.0)


def _first_token(num_accepted: torch.Tensor, final_ids: torch.Tensor,
                 draft_ids: torch.Tensor) -> torch.Tensor:  # [num_trials]
    return torch.where(num_accepted > 0, draft_ids[:, 0], final_ids)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_first_token_matches_target(with_draft_probs: bool):
    generator = torch.Generator().manual_seed(10)
    verify_len = 3
    target_probs = _random_conditional(generator, verify_len + 1)  # [verify_len + 1, vocab_size]
    target_probs[0] = TARGET_FIRST
    if with_draft_probs:
        draft_probs = DRAFT_FIRST.expand(NUM_TRIALS, verify_len, VOCAB_SIZE)
        draft_ids = torch.multinomial(DRAFT_FIRST, NUM_TRIALS * verify_len, replacement=True,
                                      generator=generator).view(NUM_TRIALS, verify_len)
    else:  # point-mass drafts chosen by any rule (here: uniformly at random)
        draft_probs = None
        draft_ids = torch.randint(0, VOCAB_SIZE, (NUM_TRIALS, verify_len), generator=generator)
    num_accepted, final_ids = rejection_sample_batched(
        target_probs=target_probs.expand(NUM_TRIALS, -1, -1), draft_ids=draft_ids,
        draft_probs=draft_probs, generator=generator)
    assert_matches_distribution(_first_token(num_accepted, final_ids, draft_ids), TARGET_FIRST,
                                what=f"first token, with_draft_probs={with_draft_probs}")


def _joint_two_positions(generator: torch.Generator, *, with_draft_probs: bool,
                         sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """Run chained speculative decoding for two emitted tokens; returns the samples
    (first * vocab_size + second, [num_trials]) and their expected distribution [vocab_size^2].

    Target and draft are conditional on the prefix: target_second[a] is the target's distribution
    after token a, so the check covers the dependence between positions."""
    target_first = TARGET_FIRST  # [vocab_size]
    target_second = _random_conditional(generator, VOCAB_SIZE)  # [vocab_size(prev), vocab_size]
    target_third = _random_conditional(generator, VOCAB_SIZE, VOCAB_SIZE)  # [prev2, prev1, vocab]
    draft_second = _random_conditional(generator, VOCAB_SIZE)  # [vocab_size(prev), vocab_size]

    # Round 1: two drafts x1 ~ draft_first, x2 ~ draft_second[x1] (or uniform point masses).
    if with_draft_probs:
        x1 = torch.multinomial(DRAFT_FIRST, NUM_TRIALS, replacement=True, generator=generator)
        x2 = torch.multinomial(draft_second[x1], 1, generator=generator).squeeze(1)
        draft_probs = torch.stack([DRAFT_FIRST.expand(NUM_TRIALS, -1), draft_second[x1]], dim=1)
    else:
        x1, x2 = torch.randint(0, VOCAB_SIZE, (2, NUM_TRIALS), generator=generator)
        draft_probs = None
    draft_ids = torch.stack([x1, x2], dim=1)  # [num_trials, 2]
    target_probs = torch.stack([target_first.expand(NUM_TRIALS, -1), target_second[x1],
                                target_third[x1, x2]], dim=1)  # [num_trials, 3, vocab_size]
    num_accepted, final_ids = sampler(target_probs=target_probs, draft_ids=draft_ids,
                                      draft_probs=draft_probs, generator=generator)
    first = torch.where(num_accepted > 0, x1, final_ids)
    second = torch.where(num_accepted > 1, x2, final_ids)

    # Round 2 for trials that emitted a single token: one fresh draft after `first`.
    needs_round_2 = num_accepted == 0
    prev = first[needs_round_2]
    num_round_2 = int(needs_round_2.sum())
    if with_draft_probs:
        y = torch.multinomial(draft_second[prev], 1, generator=generator)  # [num_round_2, 1]
        round_2_draft_probs = draft_second[prev].unsqueeze(1)
    else:
        y = torch.randint(0, VOCAB_SIZE, (num_round_2, 1), generator=generator)
        round_2_draft_probs = None
    round_2_target = torch.stack([target_second[prev], target_third[prev, y[:, 0]]], dim=1)
    accepted_2, final_2 = sampler(target_probs=round_2_target, draft_ids=y,
                                  draft_probs=round_2_draft_probs, generator=generator)
    second[needs_round_2] = torch.where(accepted_2 > 0, y[:, 0], final_2)
    expected = (target_first.unsqueeze(1) * target_second).flatten()  # [vocab_size * vocab_size]
    return first * VOCAB_SIZE + second, expected


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_joint_of_two_positions_matches_target(with_draft_probs: bool):
    generator = torch.Generator().manual_seed(20)
    samples, expected = _joint_two_positions(generator, with_draft_probs=with_draft_probs,
                                             sampler=rejection_sample_batched)
    assert_matches_distribution(samples, expected, what="joint of two emitted tokens")


def _accept_always(*, target_probs, draft_ids, draft_probs, generator):
    """Wrong verifier: accepts every draft, bonus from the last target row."""
    num_rows, verify_len = draft_ids.shape
    bonus = torch.multinomial(target_probs[:, verify_len], 1, generator=generator).squeeze(1)
    return torch.full((num_rows,), verify_len), bonus


def _recover_from_target(*, target_probs, draft_ids, draft_probs, generator):
    """Wrong verifier (a classic bug): correct acceptance test, but the recovered token is drawn
    from the target row instead of the residual max(target - draft, 0)."""
    num_accepted, _ = rejection_sample_batched(target_probs=target_probs, draft_ids=draft_ids,
                                               draft_probs=draft_probs, generator=generator)
    rows = torch.arange(draft_ids.shape[0])
    final_ids = torch.multinomial(target_probs[rows, num_accepted], 1, generator=generator)
    return num_accepted, final_ids.squeeze(1)


@pytest.mark.parametrize("wrong_sampler", [_accept_always, _recover_from_target])
def test_wrong_verifier_fails_the_same_check(wrong_sampler):
    generator = torch.Generator().manual_seed(20)
    samples, expected = _joint_two_positions(generator, with_draft_probs=True,
                                             sampler=wrong_sampler)
    assert_differs_from_distribution(samples, expected, what=wrong_sampler.__name__)
    with pytest.raises(AssertionError):
        assert_matches_distribution(samples, expected, what=wrong_sampler.__name__)


def test_per_request_path_matches_batched_core():
    """verify() draws the same tokens as the batched core on a one-row batch with the same seed."""
    setup = torch.Generator().manual_seed(30)
    for seed in range(20):
        target_probs = _random_conditional(setup, 3)
        draft_probs = _random_conditional(setup, 2)
        draft_ids = torch.multinomial(draft_probs, 1, generator=setup).view(1, 2)
        result = verify(target_probs=[target_probs], draft_ids=[draft_ids[0].tolist()],
                        draft_probs=[draft_probs], is_greedy=[False],
                        generators=[torch.Generator().manual_seed(seed)])
        num_accepted, final_ids = rejection_sample_batched(
            target_probs=target_probs.unsqueeze(0), draft_ids=draft_ids,
            draft_probs=draft_probs.unsqueeze(0), generator=torch.Generator().manual_seed(seed))
        expected = draft_ids[0, :int(num_accepted)].tolist() + [int(final_ids)]
        assert result.output_ids == [expected]


def test_greedy_ids_is_argmax_first_on_ties():
    """The fast greedy pick (`max(dim).indices`) is torch.argmax, ties to the first maximum included."""
    from dspark.sampling import greedy_ids
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, 1000, generator=g)
    assert torch.equal(greedy_ids(x), x.argmax(dim=-1))
    ties = torch.randint(0, 3, (64, 97), generator=g).float()  # many equal maxima per row
    assert torch.equal(greedy_ids(ties), ties.argmax(dim=-1))
    first = (ties == ties.max(dim=-1, keepdim=True).values).float().argmax(dim=-1)
    assert torch.equal(greedy_ids(ties), first)
