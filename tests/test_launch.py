"""Starting and ending runs: plain python, multigpu run, torchrun; exit codes and failed ranks named."""

import json
import math
import socket
import sys

import numpy as np
import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def read(runner, prefix, rank):
    return json.loads((runner.tmp_path / f"{prefix}.rank{rank}.json").read_text())


def test_plain_python_runs_one_rank_per_device_and_leaves_nothing(runner):
    # 33 rows at batch 16: the last step has 1 row, so rank 1 gets none (BatchNorm must not give NaN).
    res = runner.script("tiny.py", "--bn", "--rows", "33", "--batch", "16", "--epochs", "2", "--out", "res",
                        timeout=90)
    assert res.returncode == 0, res.stdout
    assert "rank 0 done" in res.stdout and "rank 1 done" in res.stdout
    r0, r1 = read(runner, "res", 0), read(runner, "res", 1)
    for values in r0["history"].values():
        assert all(math.isfinite(v) for v in values)
    for a, b in zip(r0["weights"], r1["weights"]):  # BatchNorm's moving statistics included
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert r0["world_size"] == 2
    assert runner.leftovers() == []


@pytest.mark.parametrize(("rank", "where", "how"), [(1, "fit", "python"), (0, "parallelize", "run")])
def test_an_exception_on_a_rank_ends_the_run_naming_it(runner, rank, where, how):
    args = ["--fail-rank", str(rank), "--fail-where", where]
    res = (runner.script("tiny.py", *args, timeout=90) if how == "python"
           else runner.cli("run", "--devices", "cpu:0,cpu:1", str(SCRIPTS / "tiny.py"), *args, timeout=90))
    assert res.returncode != 0, res.stdout
    assert f"failing on purpose on rank {rank}" in res.stdout
    assert f"rank {rank} (CPU:{rank}) exited with code 1: RuntimeError: failing on purpose on rank {rank}" in res.stdout
    assert runner.leftovers() == []


def test_exit_code_of_a_rank_is_passed_on(runner):
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", str(SCRIPTS / "tiny.py"), "--fail-rank", "1",
                     "--fail-where", "end", "--exit-code", "5", timeout=90)
    assert res.returncode == 5
    assert "rank 1 (CPU:1) exited with code 5" in res.stdout
    assert runner.leftovers() == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_matches_one_machine(runner, extra_env: dict, through_entry: bool = False) -> None:
    """torchrun on two "machines" on loopback (one rank each, on a free port) at 3:1, against ``multigpu run`` on
    one machine; ``through_entry``: each rank starts through multigpu's entry, which joins before the script
    (what JAX and TensorFlow need)."""
    port = str(_free_port())
    entry = ["-m", "multigpu.runtime.rank_entry", "script"] if through_entry else []
    nodes = [runner.start([
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
        *entry, str(SCRIPTS / "tiny.py"), "--devices", "auto", "--rows", "50", "--batch", "16",
        "--ratios", "3,1", "--out", "tr",
    ], extra_env) for node in range(2)]
    done = [runner.finish(p, timeout=150) for p in nodes]
    for r in done:
        assert r.returncode == 0, r.stdout
    # rank 0 says how the run started (the launcher, its ranks and machines, the rendezvous)
    said = f"multigpu: started by torchrun: 2 ranks on 2 machine(s), rendezvous at 127.0.0.1:{port}"
    assert said in done[0].stdout and said not in done[1].stdout, done[0].stdout[-3000:]
    one = runner.cli("run", "--devices", "cpu:0,cpu:1", str(SCRIPTS / "tiny.py"), "--rows", "50", "--batch", "16",
                     "--ratios", "3,1", "--out", "one", timeout=120, extra_env=extra_env)
    assert one.returncode == 0, one.stdout
    tr, ref = read(runner, "tr", 0), read(runner, "one", 0)
    assert tr["world_size"] == 2
    for a, b in zip(tr["weights"], ref["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert runner.leftovers() == []


def test_torchrun_two_machines_on_loopback_match_one_machine(runner):
    torchrun_matches_one_machine(runner, {"GLOO_SOCKET_IFNAME": "lo"})


class _Exited:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


@pytest.mark.parametrize(("codes", "expected"), [
    ([1, -9], (-9, 1)),      # the killed rank is the cause, not rank 0 that lost its peer
    ([None, 3, 1], (3, 1)),  # no signal, no reason given: the lowest rank that failed
    ([0, 0], (0, None)),
])
def test_the_supervisor_names_the_rank_that_caused_a_failure(codes, expected):
    from multigpu.runtime.supervisor import Supervisor

    group = Supervisor(["true"], [], 10.0)
    group.procs = [_Exited(c) for c in codes]
    assert group.wait() == expected


def test_a_rank_that_said_why_it_failed_is_named_first(tmp_path):
    from multigpu.devices import Device
    from multigpu.runtime.supervisor import Supervisor

    group = Supervisor(["true"], [Device("cpu", i) for i in range(3)], 10.0)
    group.procs = [_Exited(c) for c in (None, 1, 1)]
    group.run_dir = str(tmp_path)
    (tmp_path / "rank2.failure").write_text("ValueError: bad data\nmore")
    group.failure()  # notes when rank 2 said it
    code, rank = group.wait()
    assert group.describe_failure(code, rank) == "rank 2 (CPU:2) exited with code 1: ValueError: bad data"
