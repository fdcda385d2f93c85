"""Automatic shares on real processes: a device throttled to half speed ends with the smaller share,
the result is kept in the profile, and the next run starts from it; a device set aside and taken back."""

import json
import sys

import numpy as np
import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_throttled_rank_ends_with_the_smaller_share_and_the_profile_is_reused(runner):
    profile = runner.tmp_path / "profile.json"
    out = runner.tmp_path / "b.json"
    res = runner.cli("run", "--devices", "cpu:0,cpu:1@0.5", str(SCRIPTS / "balance.py"), str(out),
                     "--profile", str(profile), timeout=150)
    assert res.returncode == 0, res.stdout
    assert "calibrated in" in res.stdout and "of an epoch" in res.stdout
    assert "where the time went in epoch 1" in res.stdout
    got = json.loads(out.read_text())
    fast, slow = got["ratios"]
    assert 0.2 < slow / (fast + slow) < 0.45, got  # a half-speed device: about a third
    assert [row["device"] for row in got["report"]["devices"]] == ["CPU:0", "CPU:1@0.5"]
    saved = json.loads(profile.read_text())
    assert saved["version"] == 1 and len(saved["entries"]) == 1
    again = runner.cli("run", "--devices", "cpu:0,cpu:1@0.5", str(SCRIPTS / "balance.py"), str(out),
                       "--profile", str(profile), "--rows", "1024", timeout=150)
    assert again.returncode == 0, again.stdout
    assert "from the profile" in again.stdout and "calibrated in" not in again.stdout
    assert runner.leftovers() == []


@pytest.mark.parametrize("backend", ["torch", "tensorflow", "jax"])
def test_a_device_set_aside_and_taken_back_leaves_the_result_one_devices(runner, backend):
    """MULTIGPU_PARK=force sets CPU:1 aside after each fit's first epoch: its epochs have no rows and no sum, the
    metrics stay global, and at a larger batch in the next fit it trains again: weights and logs equal one
    device's, every rank holds them."""
    if backend == "tensorflow":
        pytest.importorskip("tensorflow", reason="the TensorFlow backend's tests need TensorFlow")
    out = runner.tmp_path / "two.json"
    env = {"KERAS_BACKEND": backend, "MULTIGPU_PARK": "force", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = runner.together(([sys.executable, str(SCRIPTS / "parking.py"), str(runner.tmp_path / "one.json"), "one"],
                            env),
                           ([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1",
                             str(SCRIPTS / "parking.py"), str(out), "two"], env), timeout=240)
    for res in done:
        assert res.returncode == 0, res.stdout[-3000:]
    assert done[1].stdout.count("CPU:1 set aside from epoch 2: MULTIGPU_PARK=force") == 2, done[1].stdout[-3000:]
    one, two = np.load(f"{runner.tmp_path / 'one.json'}.rank0.npz"), np.load(f"{out}.rank0.npz")
    other = np.load(f"{out}.rank1.npz")
    for k in one.files:
        assert np.max(np.abs(one[k] - two[k])) <= 1e-5 * np.max(np.abs(one[k])), k
        assert np.array_equal(two[k], other[k]), k  # the device set aside took the weights back
    got = json.loads(out.read_text())
    reference = json.loads((runner.tmp_path / "one.json").read_text())["histories"]
    for fit, fit_reference in zip(got["histories"], reference):
        for key, values in fit_reference.items():
            np.testing.assert_allclose(fit[key], values, rtol=1e-5, err_msg=key)
    for report in got["reports"]:  # each fit's last epoch: CPU:1 set aside, no rows, no time summing
        (fast, slow) = report["devices"]
        assert slow["share"] == 0.0 and slow["samples"] == 0 and fast["samples"] > 0, report
        assert fast["sum"] == 0.0, report
    # Back with a share after the fit (its calibrated one: the one-device reference runs beside the calibration,
    # which it slows down, so the two equal devices' shares need not be near even).
    assert min(got["ratios"]) > 0.05, got["ratios"]
    # multigpu.state(model).aside at each epoch's end: rank 1 from each fit's second epoch, none after the fits
    assert got["aside"] == [[], [1], [1], [], [1]] and got["after"] == [], got["aside"]
    assert runner.leftovers() == []
