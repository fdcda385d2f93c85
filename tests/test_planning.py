"""Property tests of the batch planner (pure Python)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from multigpu.planning import epoch_plan, num_steps, split, validate_ratios

ratios_st = st.lists(st.floats(min_value=0.01, max_value=1000, allow_nan=False), min_size=1, max_size=8)


@given(total=st.integers(0, 10_000), ratios=ratios_st)
def test_shares_sum_to_total_and_are_non_negative(total, ratios):
    shares = split(total, ratios)
    assert sum(shares) == total
    assert all(s >= 0 for s in shares)


@given(total=st.integers(0, 10_000), ratios=ratios_st)
def test_minimum_one_rule_only_moves_single_samples(total, ratios):
    # Where the minimum-one rule lifts a tiny share to 1, every share still
    # stays within one sample of its exact value, plus the one sample given.
    norm = sum(ratios)
    lifted = sum(1 for r in ratios if total * r / norm < 1) if total >= len(ratios) else 0
    for share, r in zip(split(total, ratios), ratios):
        assert abs(share - total * r / norm) < 1 + lifted


@given(total=st.integers(0, 10_000), ratios=ratios_st)
def test_largest_remainder_exact_when_no_share_is_below_one(total, ratios):
    norm = sum(ratios)
    if any(total * r / norm < 1 for r in ratios):
        return
    for share, r in zip(split(total, ratios), ratios):
        assert math.floor(total * r / norm) <= share <= math.ceil(total * r / norm)


@given(total=st.integers(0, 64), ratios=ratios_st)
def test_every_device_gets_a_sample_when_batch_allows(total, ratios):
    shares = split(total, ratios)
    if total >= len(ratios):
        assert all(s >= 1 for s in shares)
    else:  # too few samples for everyone: some devices get none, none gets a negative share
        assert shares.count(0) >= len(ratios) - total and min(shares) >= 0


def test_batch_smaller_than_devices_leaves_some_devices_empty():
    assert split(1, [1, 1]) == [1, 0]
    assert split(2, [1, 2, 5]) == [0, 1, 1]
    assert split(0, [3, 1]) == [0, 0]


def test_known_splits():
    assert split(256, [3, 1]) == [192, 64]
    assert split(867, [768, 560]) == [501, 366]
    assert split(10, [1, 1, 1]) == [4, 3, 3]


@given(rows=st.integers(0, 2000), batch=st.integers(1, 300), ratios=ratios_st)
def test_epoch_plan_covers_every_row_once_in_order(rows, batch, ratios):
    plan = epoch_plan(rows, batch, ratios)
    assert len(plan) == num_steps(rows, batch)
    covered = []
    for i, step in enumerate(plan):
        assert step.start == i * batch
        assert step.size == (batch if i < len(plan) - 1 else rows - i * batch)
        for r in range(len(ratios)):
            b, e = step.rows(r)
            covered.extend(range(b, e))
    assert covered == list(range(rows))


@pytest.mark.parametrize(
    "bad", [[1], [1, 2, 3], [0, 1], [-1, 1], [float("nan"), 1], [float("inf"), 1], ["a", 1], []]
)
def test_bad_ratios_are_rejected_with_the_value(bad):
    with pytest.raises(ValueError, match="ratios"):
        validate_ratios(bad, 2)
