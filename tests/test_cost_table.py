"""Tests for dspark/speculation/cost_table.py: interpolation / extrapolation rules, JSON round trip,
validation, and `profile()` with a fake clock.

    pytest tests/test_cost_table.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark.speculation.cost_table import CostTable, profile


def _table() -> CostTable:
    # 4 tokens: 100 steps/s (10 ms); 8 tokens: 50 steps/s (20 ms); 16 tokens: 25 steps/s (40 ms)
    return CostTable(num_tokens=[4, 8, 16], steps_per_second=[100.0, 50.0, 25.0],
                     draft_num_reqs=[1, 4], draft_seconds=[0.002, 0.005], meta={"device": "test"})


def test_interpolates_sps_inside_and_is_flat_below():
    table = _table()
    assert table.sps(4) == pytest.approx(100.0)
    assert table.sps(6) == pytest.approx(75.0)  # halfway between 100 and 50
    assert table.sps(12) == pytest.approx(37.5)
    assert table.sps(1) == pytest.approx(100.0)  # flat below the smallest profiled size
    assert table.step_seconds(6) == pytest.approx(1 / 75.0)


def test_extrapolates_linearly_in_time_above():
    table = _table()
    # last segment: 20 ms at 8 tokens -> 40 ms at 16 tokens, i.e. 2.5 ms per token
    assert table.step_seconds(32) == pytest.approx(0.040 + 16 * 0.0025)
    assert table.sps(32) == pytest.approx(1 / 0.080)
    single = CostTable(num_tokens=[10], steps_per_second=[20.0])
    assert single.step_seconds(20) == pytest.approx(0.1)  # proportional with one point
    assert single.sps(5) == pytest.approx(20.0)


def test_sps_array_matches_scalar_lookup():
    table = _table()
    sizes = np.arange(1, 40)
    assert np.allclose(table.sps_array(sizes), [table.sps(int(n)) for n in sizes])


def test_step_seconds_range_is_the_lookup_for_every_range():
    """The kept step seconds equal 1 / sps_array for any (start, count), before and after the kept range
    grows, and cannot be written through a returned slice."""
    table = _table()
    for start, count in [(0, 1), (3, 5), (1, 40), (0, 3), (30, 90), (7, 1)]:
        got = table.step_seconds_range(start, count)
        assert got.shape == (count,)
        assert np.array_equal(got, 1.0 / table.sps_array(np.arange(start, start + count)))
        with pytest.raises(ValueError):
            got[0] = 1.0


def test_extrapolation_never_gets_faster():
    table = CostTable(num_tokens=[1, 2], steps_per_second=[10.0, 20.0])  # noisy: 2 tokens faster
    assert table.sps(100) == pytest.approx(20.0)  # slope floored at 0, not extrapolated downwards


def test_draft_seconds():
    table = _table()
    assert table.draft_seconds_for(1) == pytest.approx(0.002)
    assert table.draft_seconds_for(2) == pytest.approx(0.003)
    assert table.draft_seconds_for(7) == pytest.approx(0.005 + 3 * 0.001)
    assert CostTable(num_tokens=[1], steps_per_second=[1.0]).draft_seconds_for(8) == 0.0


def test_save_load_round_trip(tmp_path):
    table = _table()
    path = tmp_path / "cost_table.json"
    table.save(path)
    assert CostTable.load(path) == table
    data = json.loads(path.read_text())
    data["bogus"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown cost table keys"):
        CostTable.load(path)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_tokens=[], steps_per_second=[]), "must not be empty"),
    (dict(num_tokens=[2, 1], steps_per_second=[1.0, 1.0]), "strictly increasing"),
    (dict(num_tokens=[1, 2], steps_per_second=[1.0]), "equal lengths"),
    (dict(num_tokens=[1], steps_per_second=[0.0]), "> 0"),
    (dict(num_tokens=[1], steps_per_second=[1.0], draft_num_reqs=[1], draft_seconds=[]),
     "equal lengths"),
])
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostTable(**kwargs)


def test_profile_takes_medians_after_warmup():
    now = [0.0]
    calls: list[int] = []
    # warm-up of 4, warm-up of 8, then three rounds (4, 8)
    durations = iter([99.0, 99.0] + [99.0, 99.0] + [0.01, 0.04] + [0.50, 0.04] + [0.02, 0.90])

    def step_fn(num_tokens: int) -> None:
        calls.append(num_tokens)
        now[0] += next(durations)

    table = profile(step_fn, token_counts=[8, 4], repeats=3, warmup=2, clock=lambda: now[0],
                    meta={"device": "fake"}, settle=0)
    assert calls == [4, 4, 8, 8] + [4, 8] * 3  # sorted sizes, warm-up calls first, then rounds
    assert table.num_tokens == (4, 8)
    assert table.steps_per_second == pytest.approx((1 / 0.02, 1 / 0.04))  # medians, warmup ignored
    assert table.meta == {"repeats": 3, "warmup": 2, "settle": 0, "device": "fake"}


def test_profile_times_each_step_after_a_step_of_its_own_size():
    """A step is slower right after a larger one (cold caches): with settle (the default, 3) each timed call
    follows untimed calls of the same size, so the table holds each size's own time; without it, the
    smallest size inherits the largest one's aftermath in every round."""
    now, calls, last = [0.0], [], [0]

    def step_fn(num_tokens: int) -> None:
        calls.append(num_tokens)
        now[0] += num_tokens * 0.001 + (0.005 if last[0] > num_tokens else 0.0)  # a penalty after a larger step
        last[0] = num_tokens

    table = profile(step_fn, token_counts=[1, 4, 128], repeats=3, warmup=1, clock=lambda: now[0])
    assert calls == [1, 4, 128] + ([1] * 4 + [4] * 4 + [128] * 4) * 3  # warm-up, then 3 settling + 1 timed
    assert table.steps_per_second == pytest.approx((1 / 0.001, 1 / 0.004, 1 / 0.128))
    assert table.meta["settle"] == 3
    biased = profile(step_fn, token_counts=[1, 4, 128], repeats=3, warmup=1, clock=lambda: now[0], settle=0)
    assert biased.steps_per_second[0] == pytest.approx(1 / 0.006)  # every round's 1-token step follows 128
    with pytest.raises(ValueError, match="settle"):
        profile(step_fn, token_counts=[1], repeats=1, warmup=0, clock=lambda: now[0], settle=-1)


def test_profile_with_draft_fn_and_real_clock():
    table = profile(lambda n: sum(range(n * 100)), token_counts=[1, 64], repeats=2, warmup=1,
                    draft_fn=lambda n: None, draft_num_reqs=[1, 8])
    assert table.draft_num_reqs == (1, 8)
    assert all(s > 0 for s in table.steps_per_second)
    with pytest.raises(ValueError, match="draft_num_reqs"):
        profile(lambda n: None, token_counts=[1], draft_fn=lambda n: None)
