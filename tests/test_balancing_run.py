"""Automatic shares on real processes: a device throttled to half speed ends with the smaller share,
the result is kept in the profile, and the next run starts from it."""

import json

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
