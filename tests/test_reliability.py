"""Failures end the run within its timeout, naming the rank and the cause, leaving no process behind."""

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
RUN = [sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1"]


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


def kill_rank_1_mid_epoch(runner, extra_env: dict | None = None) -> None:
    """SIGKILL to rank 1 of a long run once it trains: the run ends within 15 s naming it, leaving nothing."""
    proc = runner.start([*RUN, str(SCRIPTS / "tiny.py"), *LONG], extra_env)
    m = wait_for(proc, r"rank 1 pid (\d+) training", timeout=90)
    killed_at = time.monotonic()
    os.kill(int(m.group(1)), signal.SIGKILL)
    res = runner.finish(proc, timeout=90)
    assert time.monotonic() - killed_at < 15
    assert res.returncode != 0
    assert "rank 1 (CPU:1) was killed by signal 9" in res.stdout
    assert runner.leftovers() == []


def test_kill_9_of_rank_1_mid_epoch_ends_the_run_naming_it(runner):
    kill_rank_1_mid_epoch(runner)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_launcher_killed_with_sigkill_takes_its_ranks_with_it(runner, backend):
    """SIGKILL to ``multigpu run`` once its ranks train: Linux sends each rank SIGTERM (the supervisor's death
    signal), and each ends on it within seconds.  On JAX the ranks trained on for over a minute while JAX's
    preemption service took that SIGTERM as a notice of preemption (multigpu.backend.jax.group)."""
    if backend == "jax":
        pytest.importorskip("jax", reason="the JAX backend's tests need jax (make test installs it)")
    proc = runner.start([*RUN, str(SCRIPTS / "tiny.py"), *LONG],
                        {"KERAS_BACKEND": backend, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"})
    wait_for(proc, r"rank 1 pid \d+ training", timeout=90)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()  # (the ranks hold its other end until they end)
    assert runner.leftovers(wait=10.0) == []


@pytest.mark.parametrize(("sig", "how"), [(signal.SIGTERM, "python"), (signal.SIGINT, "run")])
def test_interrupting_the_launching_process_stops_every_rank(runner, sig, how):
    command = [sys.executable, str(SCRIPTS / "tiny.py"), *LONG] if how == "python" else [*RUN, str(
        SCRIPTS / "tiny.py"), *LONG]
    proc = runner.start(command)
    wait_for(proc, r"rank 1 pid \d+ training")
    sent = time.monotonic()
    os.kill(proc.pid, sig)
    res = runner.finish(proc, timeout=60)
    assert time.monotonic() - sent < 10
    assert res.returncode == 128 + sig
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
    assert done["epochs"] == [1, 2, 3]  # resumed after epoch 1 (the last backup)
    other = json.loads((runner.tmp_path / "res.rank1.json").read_text())
    assert other["weights"] == done["weights"]
    assert runner.leftovers() == []


def test_data_of_different_lengths_on_the_ranks_is_reported_not_hung_and_listens_on_loopback(runner):
    started = time.monotonic()
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", str(SCRIPTS / "tiny.py"), "--rows-per-rank",
                     "--print-listen", timeout=60)
    assert res.returncode != 0
    assert time.monotonic() - started < 45
    assert "The ranks received different data: fit: the numbers of rows differ (rank 0: 64, rank 1: 65)" in res.stdout
    addresses = re.findall(r"rank \d listens on (\S+)", res.stdout)
    assert addresses, res.stdout  # rank 0 serves the rendezvous
    assert all(a.startswith(("127.0.0.1:", "::1:")) for a in addresses), addresses
    assert runner.leftovers() == []


FAILURES = {
    # mode: (what every rank or the supervisor says, seconds the run may take after start-up)
    "mismatch": (r"rank 1 \(CPU:1\): the ranks' collectives did not match: this rank summed 2 gradients .* while "
                 r"rank 0 summed 4 gradients", 20),
    "sleep": (r"rank 0 \(CPU:0\): summing gradients failed: TimeoutError: rank\(s\) \[1\] did not reach the "
              r"collective within 8 s", 8 + 12),
    # evaluate's first collective is gloo's (data lengths) or the shared-memory sum: either says the same
    "catch": (r"rank 0 \(CPU:0\): .*TimeoutError: (rank\(s\) \[1\]|another rank) did not reach the collective "
              r"within 8 s", 8 + 12),
    "extra_call": (r"the ranks' collectives did not match", 20),
    "hang_exit": (r"rank 1 \(CPU:1\) failed and did not end; stopped it: RuntimeError: rank 1 fails, then hangs "
                  r"at exit", 20),
    "nan_logs": (r"the step logged 'vector' with shape \(3,\); logs must be metrics", 20),
}


@pytest.mark.parametrize("mode", list(FAILURES))
def test_every_failure_ends_the_run_within_its_timeout(runner, mode):
    pattern, limit = FAILURES[mode]
    started = time.monotonic()
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", "--timeout", "8", str(SCRIPTS / "fail.py"), mode,
                     "--timeout", "8", timeout=90)
    took = time.monotonic() - started
    assert res.returncode == 1, res.stdout
    assert re.search(pattern, res.stdout), res.stdout[-3000:]
    if mode in ("sleep", "catch"):  # a timeout names its commonest cause (a call on rank 0 only) and the fixes
        assert "`if multigpu.rank() == 0:`" in res.stdout and "make the call on every rank" in res.stdout
        assert "`multigpu run --timeout SECONDS`" in res.stdout, res.stdout[-3000:]
    assert "finished training" not in res.stdout
    assert "caught" not in res.stdout  # a collective's timeout is not an exception for the script
    assert took < limit + 15, took  # start-up (about 10 s on 2 cores) plus the limit
    assert runner.leftovers() == []
