"""Property tests of ratios, shares and step plans (pure Python)."""

import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from multigpu.planning import (
    RatioSpec,
    StepPlanner,
    capped_split,
    epoch_plan,
    num_steps,
    parse_ratios,
    split,
    validate_ratios,
)

ratios_st = st.lists(st.floats(min_value=0.01, max_value=1000, allow_nan=False), min_size=1, max_size=8)


@given(total=st.integers(0, 10_000), ratios=ratios_st)
def test_shares_sum_to_total_and_are_non_negative(total, ratios):
    shares = split(total, ratios)
    assert sum(shares) == total
    assert all(s >= 0 for s in shares)


@given(total=st.integers(0, 10_000), ratios=ratios_st)
def test_minimum_one_rule_only_moves_single_samples(total, ratios):
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
    else:
        assert shares.count(0) >= len(ratios) - total and min(shares) >= 0


def test_known_splits():
    assert split(256, [3, 1]) == [192, 64]
    assert split(867, [768, 560]) == [501, 366]
    assert split(10, [1, 1, 1]) == [4, 3, 3]
    assert split(1, [1, 1]) == [1, 0]
    assert split(2, [1, 2, 5]) == [0, 1, 1]


@given(rows=st.integers(0, 2000), batch=st.integers(1, 300), ratios=ratios_st)
def test_epoch_plan_covers_every_row_once_in_order(rows, batch, ratios):
    n = len(ratios)
    plans = [epoch_plan(rows, batch, lambda total: split(total, ratios), rank) for rank in range(n)]
    assert all(len(p) == num_steps(rows, batch) for p in plans)
    covered = []
    for i in range(num_steps(rows, batch)):
        start, plan = plans[0][i]
        assert start == i * batch
        assert plan.total == min(batch, rows - start)
        for r in range(n):
            assert plans[r][i][1].sizes == plan.sizes and plans[r][i][1].local == plan.sizes[r]
            begin, end = plans[r][i][1].rows(r, start)
            covered.extend(range(begin, end))
    assert covered == list(range(rows))


@given(total=st.integers(1, 500), ratios=ratios_st)
def test_gradient_weights_of_a_plan_sum_to_one(total, ratios):
    sizes = split(total, ratios)
    planners = [StepPlanner(lambda t: split(t, ratios), r) for r in range(len(ratios))]
    weights = [p.plan(total).weight for p in planners]
    assert math.isclose(sum(weights), 1.0)
    assert all(math.isclose(w, s / total) for w, s in zip(weights, sizes))


@pytest.mark.parametrize(
    "bad", [[1], [1, 2, 3], [0, 1], [-1, 1], [float("nan"), 1], [float("inf"), 1], ["a", 1], []]
)
def test_bad_ratios_are_rejected_with_the_value(bad):
    with pytest.raises(ValueError, match="ratios"):
        validate_ratios(bad, 2)


def test_one_parser_for_every_spelling_of_ratios():
    assert parse_ratios(None) == RatioSpec("default")
    assert parse_ratios("auto") == parse_ratios(" AUTO ") == RatioSpec("auto")
    assert parse_ratios([3, 1]) == parse_ratios("3,1") == parse_ratios((3.0, 1.0)) == RatioSpec("fixed", (3.0, 1.0))
    assert parse_ratios("p/profile.json") == RatioSpec("profile", path="p/profile.json")
    assert parse_ratios(os.path.join("x", "y.json")).kind == "profile"
    from pathlib import Path

    assert parse_ratios(Path("a.json")) == RatioSpec("profile", path="a.json")
    assert parse_ratios("3,1").text() == "3,1" and parse_ratios("auto").text() == "auto"
    with pytest.raises(ValueError, match=r"`ratios` must be .*Received: ratios='fast'"):
        parse_ratios("fast")
    with pytest.raises(ValueError, match=r"one entry per device \(3 devices\), got 2"):
        parse_ratios("3,1", 3)
    with pytest.raises(ValueError, match="Received: ratios=4"):
        parse_ratios(4)


@given(total=st.integers(0, 1024), quantum=st.integers(2, 64), ratios=st.lists(st.floats(0.1, 10.0), min_size=2,
                                                                                 max_size=4), data=st.data())
def test_a_quantum_keeps_every_share_on_its_grid_but_one_remainder(total, quantum, ratios, data):
    caps = data.draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(1, 1024)), min_size=len(ratios),
                                                   max_size=len(ratios))))
    if caps is not None and total > sum(math.inf if c is None else c for c in caps):
        return
    shares = capped_split(total, ratios, caps, quantum)
    assert sum(shares) == total
    assert caps is None or all(c is None or s <= c for s, c in zip(shares, caps))
    off = [s for s in shares if s % quantum]
    if caps is None and total >= quantum:
        assert len(off) <= 1 and (not off or off[0] % quantum == total % quantum)
        exact = [total * r / sum(ratios) for r in ratios]
        if min(exact) >= quantum:  # no device raised to its one unit: each share within a unit of its exact value
            assert max(abs(s - e) for s, e in zip(shares, exact)) <= quantum + total % quantum


def test_a_quantum_splits_in_units():
    assert capped_split(256, [2, 1], quantum=16) == [176, 80]
    assert capped_split(100, [2, 1], quantum=6) == [70, 30]  # 4 left: to the largest ratio
    assert capped_split(96, [1, 1], [40, 60], 16) == [40, 56]  # units do not fit the caps: rows one by one


def test_capped_split_moves_the_excess_and_names_the_largest_batch():
    assert capped_split(100, [1, 1], [20, None]) == [20, 80]
    with pytest.raises(ValueError, match="largest global batch that fits is 60"):
        capped_split(100, [1, 1], [20, 40])


@given(total=st.integers(0, 4096), ratios=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=5), data=st.data())
def test_capped_split_respects_caps_and_gives_everyone_with_room_a_share(total, ratios, data):
    caps = data.draw(st.lists(st.one_of(st.none(), st.integers(1, 2048)), min_size=len(ratios),
                              max_size=len(ratios)))
    room = sum(math.inf if c is None else c for c in caps)
    if total > room:
        with pytest.raises(ValueError, match="largest global batch that fits is"):
            capped_split(total, ratios, caps)
        return
    shares = capped_split(total, ratios, caps)
    assert sum(shares) == total
    for share, cap in zip(shares, caps):
        assert share >= 0
        assert cap is None or share <= cap
    if total >= len(ratios):
        assert all(s >= 1 for s in shares)


def test_the_planner_hands_plans_back_in_order_and_checks_rows():
    ratios = [3.0, 1.0]
    planner = StepPlanner(lambda t: split(t, ratios), rank=1)
    first, second = planner.plan(64), planner.plan(5)
    assert planner.plan(10, for_step=False).sizes == (8, 2)  # evaluation plans are not queued
    assert planner.take(16) == first and first.weight == 0.25
    assert planner.take(1) == second and second.sizes == (4, 1)
    with pytest.raises(RuntimeError, match="did not cut"):
        planner.take(3)
    planner.plan(64)
    with pytest.raises(RuntimeError, match=r"rank 1's training step received a batch of 15 rows, but the next batch "
                       r"that fit\(\) or train_on_batch\(\) cut gives this rank 16 .*Train only through the parallel "
                       r"model's fit\(\) or train_on_batch\(\), one call at a time"):
        planner.take(15)
    planner.plan(64)
    planner.reset()
    with pytest.raises(RuntimeError, match="did not cut"):
        planner.take(16)
