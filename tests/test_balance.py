"""Property tests of the rebalancing maths and the profile file."""

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multigpu.balance import Rebalancer, capped_split, predicted_step_time
from multigpu.calibrate import ProfileError, read_profile, write_profile

speeds_st = st.lists(st.floats(min_value=1.0, max_value=1000.0), min_size=2, max_size=6)


@given(speeds=speeds_st, batch=st.integers(16, 2048))
@settings(max_examples=60, deadline=None)
def test_converges_to_speed_proportional_shares(speeds, batch):
    rb = Rebalancer([1.0] * len(speeds), batch_size=batch, smoothing=0.5, threshold=0.0)
    for _ in range(30):
        shares = capped_split(batch, rb.ratios)
        rb.observe([b / s for b, s in zip(shares, speeds)], shares)
    total = sum(speeds)
    ideal = predicted_step_time(capped_split(batch, [s / total for s in speeds]), speeds)
    got = predicted_step_time(capped_split(batch, rb.ratios), speeds)
    # within one sample of the ideal on the slowest device
    assert got <= ideal + 1.0 / min(speeds) + 1e-9


@given(speeds=speeds_st, batch=st.integers(16, 512), noise=st.floats(0.0, 0.02), seed=st.integers(0, 10**6))
@settings(max_examples=40, deadline=None)
def test_stable_under_noise(speeds, batch, noise, seed):
    rng = random.Random(seed)
    total = sum(speeds)
    rb = Rebalancer([s / total for s in speeds], batch_size=batch, smoothing=0.3, threshold=0.05)
    for _ in range(50):
        shares = capped_split(batch, rb.ratios)
        times = [b / (s * (1 + rng.uniform(-noise, noise))) if b else 0.0 for b, s in zip(shares, speeds)]
        rb.observe(times, shares)
    # Starting balanced, +-2% noise does not make shares flap with a 5%
    # threshold: at most one move (integer rounding of a small batch can make
    # the first re-split a real improvement), never back and forth.
    assert rb.changes <= 1


@given(total=st.integers(0, 4096), ratios=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=5),
       data=st.data())
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


def test_capped_split_moves_the_excess():
    assert capped_split(100, [1, 1], [20, None]) == [20, 80]
    with pytest.raises(ValueError, match="largest global batch that fits is 60"):
        capped_split(100, [1, 1], [20, 40])


def test_a_device_that_reports_nothing_keeps_its_estimate():
    rb = Rebalancer([1.0, 1.0], batch_size=100, threshold=0.0)
    rb.observe([0.5, 1.0], [50, 50])
    before = list(rb.speeds)
    rb.observe([0.5, 0.0], [50, 0])
    assert rb.speeds[1] == before[1]
    assert all(r > 0 for r in rb.ratios)


def test_profile_round_trip_and_bad_profiles(tmp_path):
    path = tmp_path / "p.json"
    entry = {"devices": ["cpu:0", "cpu:1@0.5"], "speeds": [400.0, 200.0], "ratios": [0.667, 0.333]}
    write_profile(path, "abc@cpu:0,cpu:1@0.5", entry)
    assert read_profile(path, "abc@cpu:0,cpu:1@0.5", ["cpu:0", "cpu:1@0.5"]) == entry
    assert read_profile(path) == entry
    with pytest.raises(ProfileError, match="measured on devices"):
        read_profile(path, "abc@cpu:0,cpu:1@0.5", ["cpu:0", "cpu:1"])
    with pytest.raises(ProfileError, match="no entry"):
        read_profile(path, "other", None)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        read_profile(path)
    path.write_text(json.dumps({"version": 1, "entries": {"k": {"ratios": [-1, 2]}}}))
    with pytest.raises(ProfileError, match="no valid ratios"):
        read_profile(path)
    with pytest.raises(ProfileError, match="no profile"):
        read_profile(tmp_path / "missing.json")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_throttled_rank_ends_with_the_smaller_share_and_profile_is_reused(runner):
    profile = runner.tmp_path / "profile.json"
    out = runner.tmp_path / "b.json"
    res = runner.script("balance.py", str(out), "--profile", str(profile), timeout=150)
    assert res.returncode == 0, res.stdout
    assert "calibrated in" in res.stdout and "of an epoch" in res.stdout
    assert "where the time went in epoch 1" in res.stdout
    got = json.loads(out.read_text())
    fast, slow = got["ratios"]
    assert slow < fast, got
    assert 0.2 < slow / (fast + slow) < 0.45, got  # a half-speed device: about a third
    assert [row["device"] for row in got["report"]["devices"]] == ["CPU:0", "CPU:1@0.5"]
    # The next run starts from the profile instead of calibrating.
    saved = json.loads(profile.read_text())
    assert saved["version"] == 1 and len(saved["entries"]) == 1
    again = runner.script("balance.py", str(out), "--profile", str(profile), "--rows", "1024", timeout=150)
    assert again.returncode == 0, again.stdout
    assert "from the profile" in again.stdout and "calibrated in" not in again.stdout
    # A corrupt profile gives a clear warning and falls back to calibrating.
    profile.write_text("{broken")
    bad = runner.script("balance.py", str(out), "--profile", str(profile), "--rows", "1024", timeout=150,
                        extra_env={"PYTHONWARNINGS": "default"})
    assert bad.returncode == 0, bad.stdout
    assert "cannot use the profile" in bad.stdout and "not valid JSON" in bad.stdout
    assert "calibrated in" in bad.stdout
    assert runner.leftovers() == []


def test_noise_raises_the_bar_but_a_real_slowdown_still_moves_shares():
    rb = Rebalancer([2.0, 1.0], batch_size=256, smoothing=0.3, threshold=0.02)
    # Device 1 measures 316..357 samples/s around a true 330: +-6% noise.
    for s1 in (316, 357, 327, 349, 320, 352, 318, 345):
        shares = capped_split(256, rb.ratios)
        rb.observe([shares[0] / 640, shares[1] / s1], shares)
    assert rb.noise() > 0.03
    assert rb.changes <= 1  # no flapping between 62% and 66%
    before = rb.changes
    for _ in range(6):  # then it really halves
        shares = capped_split(256, rb.ratios)
        rb.observe([shares[0] / 640, shares[1] / 165], shares)
    assert rb.changes > before
    assert rb.ratios[0] / sum(rb.ratios) > 0.75
