"""Failures end cleanly: killed ranks, interrupts, restarts, bad data."""

import json
import os
import re
import signal
import sys
import time

import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

LONG = ["--rows", "400000", "--batch", "64", "--epochs", "50", "--announce"]


def wait_for(proc, pattern: str, timeout: float = 60.0) -> re.Match:
    """Reads the process's output until ``pattern`` appears; returns the match."""
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
        m = re.search(pattern, seen)
        if m:
            return m
    pytest.fail(f"{pattern!r} did not appear:\n{seen[-2000:]}")


def test_kill_9_of_rank_1_mid_epoch_ends_the_run_naming_it(runner):
    proc = runner.start([sys.executable, str(SCRIPTS / "tiny.py"), *LONG])
    m = wait_for(proc, r"rank 1 pid (\d+) training")
    killed_at = time.monotonic()
    os.kill(int(m.group(1)), signal.SIGKILL)
    res = runner.finish(proc, timeout=90)
    assert time.monotonic() - killed_at < 60
    assert res.returncode != 0
    assert "rank 1 (CPU:1) was killed by signal 9" in res.stdout
    assert runner.leftovers() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launching_process_stops_every_rank(runner, sig):
    proc = runner.start([sys.executable, str(SCRIPTS / "tiny.py"), *LONG])
    wait_for(proc, r"rank 1 pid \d+ training")
    sent = time.monotonic()
    os.kill(proc.pid, sig)
    res = runner.finish(proc, timeout=60)
    assert time.monotonic() - sent < 15
    assert res.returncode != 0
    assert runner.leftovers() == []


def test_interrupting_multigpu_run_stops_every_rank(runner):
    proc = runner.start([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1",
                         str(SCRIPTS / "tiny.py"), *LONG])
    wait_for(proc, r"rank 1 pid \d+ training")
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    res = runner.finish(proc, timeout=60)
    assert time.monotonic() - sent < 15
    assert res.returncode == 128 + signal.SIGINT
    assert runner.leftovers() == []


def test_restart_resumes_from_backup_and_finishes_all_epochs(runner):
    backup = runner.tmp_path / "backup"
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", "--max-restarts", "1", str(SCRIPTS / "tiny.py"),
                     "--rows", "320", "--batch", "32", "--epochs", "4", "--backup", str(backup),
                     "--die-rank", "1", "--out", str(runner.tmp_path / "res"), timeout=150)
    assert res.returncode == 0, res.stdout
    assert "rank 1 dies in epoch 2" in res.stdout
    assert "rank 1 (CPU:1) was killed by signal 9" in res.stdout
    assert "restarting all ranks (1 of 1)" in res.stdout
    done = json.loads((runner.tmp_path / "res.rank0.json").read_text())
    # The restarted run resumed after epoch 1 (the last backup) and trained epochs 2 to 4.
    assert done["epochs"] == [1, 2, 3]
    other = json.loads((runner.tmp_path / "res.rank1.json").read_text())
    assert other["weights"] == done["weights"]
    assert runner.leftovers() == []


def test_data_of_different_lengths_on_the_ranks_is_reported_not_hung(runner):
    started = time.monotonic()
    res = runner.script("tiny.py", "--rows-per-rank", timeout=60)
    assert res.returncode != 0
    assert time.monotonic() - started < 45
    for r in (0, 1):
        assert f"[rank{r}]" in res.stdout
    assert "The ranks received different data: fit: the numbers of rows differ (rank 0: 64, rank 1: 65)" in res.stdout
    assert runner.leftovers() == []


def test_a_single_machine_run_listens_on_loopback_only(runner):
    res = runner.script("tiny.py", "--print-listen", timeout=90)
    assert res.returncode == 0, res.stdout
    addresses = re.findall(r"rank 0 listens on (\S+)", res.stdout)
    assert addresses, res.stdout  # rank 0 hosts the store, so it listens somewhere
    for address in addresses + re.findall(r"rank 1 listens on (\S+)", res.stdout):
        assert address.startswith("127.0.0.1:") or address.startswith("::1:"), address
