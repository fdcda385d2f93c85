"""Launching and ending runs: plain python, ragged batches, failures, torchrun."""

import json
import math
import socket
import sys

import numpy as np
import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def read(runner, rank):
    return json.loads((runner.tmp_path / f"res.rank{rank}.json").read_text())


def test_ragged_last_batch_of_one_row_with_batchnorm(runner):
    # 33 rows at batch 16: the last step has 1 row, so rank 1 gets none.
    res = runner.script("tiny.py", "--bn", "--rows", "33", "--batch", "16", "--epochs", "2",
                        "--out", "res", timeout=90)
    assert res.returncode == 0, res.stdout
    r0, r1 = read(runner, 0), read(runner, 1)
    for values in r0["history"].values():
        assert all(math.isfinite(v) for v in values)
    for w in r0["weights"]:
        assert np.all(np.isfinite(w))
    # weights, including BatchNorm's moving statistics, agree on every rank
    for a, b in zip(r0["weights"], r1["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert runner.leftovers() == []


def test_script_exit_leaves_no_process(runner):
    res = runner.script("tiny.py", timeout=90)
    assert res.returncode == 0, res.stdout
    assert "rank 0 done" in res.stdout and "rank 1 done" in res.stdout
    assert runner.leftovers() == []


@pytest.mark.parametrize("where", ["parallelize", "fit"])
@pytest.mark.parametrize("rank", [0, 1])
def test_exception_on_a_rank_ends_the_run(runner, rank, where):
    res = runner.script("tiny.py", "--fail-rank", str(rank), "--fail-where", where, timeout=90)
    assert res.returncode != 0, res.stdout
    assert f"failing on purpose on rank {rank}" in res.stdout
    if rank == 1:
        assert "rank 1 (CPU:1)" in res.stdout
    assert runner.leftovers() == []


def test_exit_code_of_another_rank_is_passed_on(runner):
    res = runner.script("tiny.py", "--fail-rank", "1", "--fail-where", "end", "--exit-code", "5", timeout=90)
    assert res.returncode != 0
    assert "rank 1 (CPU:1) exited with code 5" in res.stdout
    assert runner.leftovers() == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_machines_on_loopback_match_one_machine(runner):
    port = str(_free_port())
    nodes = []
    for node in range(2):
        nodes.append(runner.start([
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
            str(SCRIPTS / "tiny.py"), "--devices", "auto", "--rows", "50", "--batch", "16",
            "--ratios", "3,1", "--out", "tr",
        ], extra_env={"GLOO_SOCKET_IFNAME": "lo"}))
    results = [runner.finish(p, timeout=120) for p in nodes]
    for r in results:
        assert r.returncode == 0, r.stdout
    one = runner.script("tiny.py", "--devices", "cpu:0,cpu:1", "--rows", "50", "--batch", "16",
                        "--ratios", "3,1", "--out", "one", timeout=90)
    assert one.returncode == 0, one.stdout
    tr = json.loads((runner.tmp_path / "tr.rank0.json").read_text())
    ref = json.loads((runner.tmp_path / "one.rank0.json").read_text())
    assert tr["world_size"] == 2
    for a, b in zip(tr["weights"], ref["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert runner.leftovers() == []


class _Exited:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


@pytest.mark.parametrize(("codes", "expected"), [
    ([1, -9], (-9, 1)),      # the killed rank is the cause, not rank 0 that lost its peer
    ([None, 3, 1], (3, 1)),  # no signal: the lowest failed rank
    ([0, 0], (0, None)),
])
def test_the_launcher_names_the_rank_that_caused_a_failure(codes, expected):
    from multigpu.runtime.supervisor import Supervisor

    group = Supervisor(["true"], [], 10.0)
    group.procs = [_Exited(c) for c in codes]
    assert group.wait() == expected
