"""The shared-memory sum between two real processes (torch only): sums, growth, mismatches, timeouts."""

import socket
import sys
import time

import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


def start_pair(runner, mode):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [runner.start([sys.executable, str(SCRIPTS / "shm_sum.py"), str(r), port, mode]) for r in (0, 1)]


def test_sums_of_any_size_and_dtype_are_exact(runner):
    results = [runner.finish(p, timeout=40) for p in start_pair(runner, "sums")]
    for r, res in enumerate(results):
        assert res.returncode == 0, res.stdout
        assert f"rank {r} sums ok" in res.stdout
    assert not [p for p in __import__("pathlib").Path("/dev/shm").glob("multigpu-*")]  # unlinked at once
    assert runner.leftovers() == []


def test_ranks_with_different_sizes_both_get_an_error_naming_them(runner):
    results = [runner.finish(p, timeout=40) for p in start_pair(runner, "mismatch")]
    assert "rank 0: the ranks' collectives did not match: this rank summed 10 values, while rank 1 summed" in (
        results[0].stdout.replace("multigpu: multigpu", "multigpu")) or "did not match" in results[0].stdout
    for res in results:
        assert res.returncode == 1 and "the ranks' collectives did not match" in res.stdout, res.stdout


def test_a_rank_that_never_comes_times_out_the_others(runner):
    started = time.monotonic()
    procs = start_pair(runner, "late")
    res = runner.finish(procs[0], timeout=40)
    assert res.returncode == 1
    assert "TimeoutError: rank(s) [1] did not reach the collective within 3 s" in res.stdout
    # the commonest cause and the fix follow: a call made under `if multigpu.rank() == 0:`, and the longer wait
    assert "`if multigpu.rank() == 0:`" in res.stdout and "make the call on every rank" in res.stdout, res.stdout
    assert "timeout=SECONDS" in res.stdout and "multigpu run --timeout SECONDS" in res.stdout
    assert time.monotonic() - started < 20
    procs[1].kill()
    runner.finish(procs[1], timeout=10)
