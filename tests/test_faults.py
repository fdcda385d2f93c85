"""A lost device: the survivors take its rows from the step it was lost in, and the run stays exact.

Three CPU devices at 1:2:5 train a classifier with validation and a
checkpoint every epoch; ``MULTIGPU_FAULT`` kills ranks (``SIGKILL``, or
``SIGSTOP`` for a silent one) at every point of a step, rank 0 included (the
forward pass in the run that falls below ``min_devices``).
Each run loses two of its three devices, so it ends on one; its weights and
History must equal one device's run on the same data to float rounding, and
nothing may be left: no process, no shared memory, no half-written
checkpoint.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SCRIPTS, run_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

THREE = ["--devices", "cpu:0,cpu:1,cpu:2", "--ratios", "1,2,5"]
TWO = ["--devices", "cpu:0,cpu:1", "--ratios", "1,3"]
_RUN = [sys.executable, "-m", "multigpu", "run", "--devices"]  # then the devices: the ranks alone


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """One device's run on torch and on TensorFlow, at once."""
    folder = tmp_path_factory.mktemp("plain")
    done = run_together(*({"args": [sys.executable, str(SCRIPTS / "faults.py"), str(folder / f"{backend}.npz"),
                                    "--plain"],
                           "env": {**os.environ, "OMP_NUM_THREADS": "1", "KERAS_BACKEND": backend}}
                          for backend in ("torch", "tensorflow")), timeout=180)
    for res in done:
        assert res.returncode == 0, res.stdout[-3000:]
    return {backend: dict(np.load(folder / f"{backend}.npz")) for backend in ("torch", "tensorflow")}


@pytest.fixture(scope="module")
def one_device(references):
    return references["torch"]


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("multigpu-*")}


def _compare(got_path: Path, want: dict) -> list[int]:
    got = dict(np.load(got_path))
    for k, value in want.items():
        if k.startswith("w"):
            err = float(np.abs(got[k] - value).max() / np.abs(value).max())
            assert err < 1e-5, (k, err)
    hw, hg = json.loads(str(want["history"])), json.loads(str(got["history"]))
    assert hw.keys() == hg.keys()
    for k in hw:
        np.testing.assert_allclose(hg[k], hw[k], rtol=1e-5, err_msg=k)
    return [e["rank"] for e in json.loads(str(got["lost"]))]


@pytest.mark.parametrize(("faults", "transport", "lost", "own_step"), [
    ("1:forward/stop:4,2:sum:14", "shm", [1, 2], False),  # silent (SIGSTOP) before its forward pass; inside the sum
    # A step of the model's own, whose logs are summed after its update: rank 2 after the gradients' sum, before
    # its update (the others' updates are put back when their logs' sum fails); rank 0 in validation.
    ("2:update:5,0:validation:2", "shm", [2, 0], True),
    # Over gloo, step 5's sum reaches rank 0 and not rank 1 (its 6th sum: the first is before training), as a ring
    # broken midway leaves it: rank 1 takes rank 0's state and that step's logs; rank 0 later, writing the
    # checkpoint. (A rank reading its rows: test_inputs_read_once_per_machine_go_on_without_a_lost_rank.)
    ("1:sum/drop:6,2:update:5,0:save:2", "gloo", [2, 0], False),
], ids=["silent-sum", "own-step-update-validation-rank0", "sum-reached-one-save-rank0-gloo"])
def test_the_survivors_finish_every_epoch_exactly(runner, one_device, faults, transport, lost, own_step):
    before = _shm()
    out = runner.tmp_path / "run.npz"
    res = runner.run([*_RUN, THREE[1], str(SCRIPTS / "faults.py"), str(out), *THREE, "--min-devices", "1",
                      *(["--own-step"] if own_step else [])],
                     timeout=200, extra_env={"MULTIGPU_FAULT": faults, "MULTIGPU_TRANSPORT": transport})
    _survivors_finished(runner, res, out, one_device, faults, lost, before)


def _survivors_finished(runner, res, out, want: dict, faults: str, lost: list[int], before: set[str]) -> None:
    """The run ended well, equal to one device's, each loss named as it happened, the step taken again over
    the ranks left, and nothing left behind (no process, no shared memory, no half-written checkpoint)."""
    assert res.returncode == 0, res.stdout[-3000:]
    assert _compare(out, want) == lost
    for r in lost:
        how = ("stopped answering (no heartbeat for 5 s)" if f"{r}:forward/stop" in faults
               else "was killed by signal 9 (SIGKILL)")
        assert f"rank {r} (CPU:{r}) {how}; going on with" in res.stdout
    assert res.stdout.count("again on 2 devices") + res.stdout.count("again on 1 device") >= 1
    if "sum/drop" in faults:
        assert ("the sum of step 5 reached rank(s) [0] and not [1] before rank 2 was lost: rank(s) [1] took rank 0's "
                "weights, optimizer state and logs of that step") in res.stdout
    assert runner.leftovers() == []
    assert _shm() <= before
    assert sorted(p.name for p in runner.tmp_path.iterdir() if "checkpoint" in p.name) == ["checkpoint.keras"]


@pytest.fixture(scope="module")
def one_device_tf(references):
    return references["tensorflow"]


@pytest.mark.parametrize(("faults", "transport", "lost", "min_devices"), [
    ("1:forward:4", "shm", [1], "2"),  # issue 53's run: rank 1 killed with SIGKILL mid-epoch
    # silent (SIGSTOP) before its forward pass, then rank 2 inside the sum; rank 0 in validation, over gloo
    pytest.param("1:forward/stop:4,2:sum:14", "shm", [1, 2], "1", marks=pytest.mark.outside),
    pytest.param("2:update:5,0:validation:2", "gloo", [2, 0], "1", marks=pytest.mark.outside),
    # Over gloo, step 5's sum reaches rank 0 and not rank 1 (its 5th sum: none before training here): rank 1
    # takes rank 0's state and that step's logs; rank 0 later, writing the checkpoint.
    pytest.param("1:sum/drop:5,2:update:5,0:save:2", "gloo", [2, 0], "1", marks=pytest.mark.outside),
], ids=["killed-forward", "silent-sum", "update-validation-rank0-gloo", "sum-reached-one-save-rank0-gloo"])
def test_on_tensorflow_the_survivors_finish_every_epoch_exactly(runner, one_device_tf, faults, transport, lost,
                                                                min_devices):
    """TensorFlow sums on the engine torch sums on (shared memory, gloo), and goes on without a lost device
    the same way: three devices at 1:2:5, the survivors take the lost ranks' rows from the step they were lost
    in, and the weights and History equal one device's on TensorFlow."""
    before = _shm()
    out = runner.tmp_path / "run.npz"
    res = runner.run([*_RUN, THREE[1], str(SCRIPTS / "faults.py"), str(out), *THREE, "--min-devices", min_devices],
                     timeout=220, extra_env={"MULTIGPU_FAULT": faults, "MULTIGPU_TRANSPORT": transport,
                                             "KERAS_BACKEND": "tensorflow"})
    _survivors_finished(runner, res, out, one_device_tf, faults, lost, before)


@pytest.mark.parametrize(("source", "faults", "lost", "backend"), [
    ("pydataset", "0:forward:4", [0], "torch"),  # rank 0 read a turn of the batches: rank 1 reads it on
    ("generator", "1:input:5", [1], "torch"),  # not the generator's reader: rank 0 reads on, the batch is cut again
    ("dataloader", "1:forward:4", [1], "torch"),  # batches drawn ahead with rows for rank 1: cut again, loaded here
    pytest.param("generator", "1:input:5", [1], "tensorflow", marks=pytest.mark.outside),
    pytest.param("pydataset", "0:forward:4", [0], "tensorflow", marks=pytest.mark.outside),
])
def test_inputs_read_once_per_machine_go_on_without_a_lost_rank(runner, request, source, faults, lost, backend):
    """The same batches from a PyDataset with two workers (each rank reads a turn of them), a generator (rank 0
    reads it) or a DataLoader over a map-style dataset with two workers (each rank loads its rows, a few batches
    ahead): the ranks left stop waiting for the lost one, cut the batch again (from its file, or loading its
    items), and take over its turn of reading; the result is one device's."""
    before = _shm()
    out = runner.tmp_path / "run.npz"
    res = runner.run([*_RUN, TWO[1], str(SCRIPTS / "faults.py"), str(out), *TWO, "--min-devices", "1",
                      "--input", source], timeout=200, extra_env={"MULTIGPU_FAULT": faults, "KERAS_BACKEND": backend})
    assert res.returncode == 0, res.stdout[-3000:]
    want = request.getfixturevalue("one_device" if backend == "torch" else "one_device_tf")
    assert _compare(out, want) == lost
    assert runner.leftovers() == []
    assert _shm() <= before  # the batch files of the input included


def test_losing_the_reader_of_a_generator_ends_the_run_saying_why(runner):
    res = runner.run([*_RUN, TWO[1], str(SCRIPTS / "faults.py"), str(runner.tmp_path / "run.npz"), *TWO,
                      "--min-devices", "1", "--input", "generator"], timeout=200,
                     extra_env={"MULTIGPU_FAULT": "0:forward:3"})
    assert res.returncode != 0
    assert ("the rank that read this input for its machine (rank 0) was lost: a generator, iterator or tf.data "
            "stream cannot be read on from where it was by another rank") in res.stdout
    assert runner.leftovers() == []


@pytest.mark.parametrize("backend", ["torch", pytest.param("tensorflow", marks=pytest.mark.outside)])
def test_a_lost_rank_started_again_rejoins_and_the_result_stays_exact(runner, request, backend):
    """Rank 0 (the writer) killed in epoch 1 under ``--max-restarts 1``: rank 1 writes from then on, rank 0's new
    process rejoins at a step of a later epoch, and the run ends on all three devices, equal to one device."""
    want = request.getfixturevalue("one_device" if backend == "torch" else "one_device_tf")
    before = _shm()
    out = runner.tmp_path / "run.npz"
    res = runner.cli("run", *THREE, "--max-restarts", "1", "--min-devices", "2", str(SCRIPTS / "faults.py"),
                     str(out), "--step-sleep", "1.0", timeout=200,
                     extra_env={"MULTIGPU_FAULT": "0:forward:2", "KERAS_BACKEND": backend})
    assert res.returncode == 0, res.stdout[-3000:]
    assert _compare(out, want) == [0]
    assert json.loads(str(np.load(out)["joined"]))[0]["rank"] == 0
    assert "starting rank 0 (CPU:0) again; it rejoins at a step of fit (0 restart(s) left)." in res.stdout
    assert "rank 0 (CPU:0) rejoined at epoch " in res.stdout
    assert "rows CPU:1 12, CPU:2 30, CPU:0 6 of 48" in res.stdout  # the shares at 1:2:5 again
    assert res.stdout.count("shares [0.125, 0.25, 0.625]") == 3  # every rank ends with them
    assert runner.leftovers() == []
    assert _shm() <= before


@pytest.mark.parametrize("backend", ["torch", pytest.param("tensorflow", marks=pytest.mark.outside)])
def test_below_min_devices_the_run_ends_naming_what_is_left(runner, backend):
    res = runner.cli("run", *THREE, "--min-devices", "2", str(SCRIPTS / "faults.py"),
                     str(runner.tmp_path / "run.npz"), timeout=200,
                     extra_env={"MULTIGPU_FAULT": "1:forward:3,2:forward:6", "KERAS_BACKEND": backend})
    assert res.returncode != 0
    assert "rank 1 (CPU:1) was killed by signal 9 (SIGKILL); going on with 2 device(s)" in res.stdout
    assert ("rank 2 (CPU:2) was killed by signal 9 (SIGKILL); 1 device(s) left (CPU:0), fewer than "
            "min_devices=2: ending the run.") in res.stdout
    assert runner.leftovers() == []
    assert not (runner.tmp_path / "run.npz").exists()


# ------------------------------------------------------------------ in-process checks
def test_min_devices_is_checked_and_named():
    from multigpu.arguments import min_devices as _min_devices

    assert _min_devices(None, 3) is None and _min_devices(2, 3) == 2
    for bad in (0, 4, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"from 1 to the 3 devices. Received: min_devices="):
            _min_devices(bad, 3)


def test_min_devices_says_where_a_lost_device_still_ends_the_run(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from multigpu import api, membership
    from multigpu.devices import parse_devices

    monkeypatch.setenv("MULTIGPU_RUN_DIR", str(tmp_path))
    monkeypatch.setattr(membership, "start_heartbeat", lambda rank: None)
    torch_ = SimpleNamespace(name="torch", elastic=True, sums_on_host=False)
    tensorflow = SimpleNamespace(name="tensorflow", elastic=True, sums_on_host=True)
    ours = SimpleNamespace(name="multigpu", knows_every_device=True)
    for devices, facts, environment, allowed, said in [
        (["cpu:0", "cpu:1"], torch_, ours, True, None),
        (["gpu:0", "gpu:1"], torch_, ours, False, "on GPUs alone (an NCCL group) a lost device ends the run"),
        (["gpu:0", "cpu:0"], torch_, ours, True, None),  # one gloo group for both
        (["cpu:0", "cpu:1"], tensorflow, ours, True, None),
        (["gpu:0", "gpu:1"], tensorflow, ours, True, None),  # TensorFlow sums on the host: a gloo group
        (["cpu:0", "cpu:1"], SimpleNamespace(name="jax", elastic=False, sums_on_host=False), ours, False,
         "on the jax backend a lost device ends"),
        (["cpu:0", "cpu:1"], torch_, SimpleNamespace(name="torchrun", knows_every_device=False), False,
         "on torchrun a lost device ends the run"),
    ]:
        runtime = SimpleNamespace(devices=parse_devices(devices, num_gpus=lambda: 2), environment=environment, rank=0)
        comm, lines = SimpleNamespace(min_devices=None), []
        api._allow_shrink(runtime, comm, 1, facts, lines.append)
        assert (comm.min_devices == 1) is allowed, devices
        assert (lines == []) if said is None else (said in lines[0] and "BackupAndRestore" in lines[0]), lines


def test_a_fault_plan_names_what_is_allowed(monkeypatch):
    from multigpu import membership

    monkeypatch.setattr(membership, "_PLAN", None)
    monkeypatch.setenv("MULTIGPU_FAULT", "1:backward")
    with pytest.raises(ValueError, match=r"RANK:POINT\[:N\] entries, POINT one of forward, sum, update"):
        membership.at("forward", 1)
    monkeypatch.setattr(membership, "_PLAN", None)
    monkeypatch.setenv("MULTIGPU_FAULT", "1:sum:3")
    membership.at("sum", 0)  # another rank's fault: nothing happens here
    assert membership._PLAN == {}
    monkeypatch.setattr(membership, "_PLAN", None)
    monkeypatch.setenv("MULTIGPU_FAULT", "1:forward/drop")  # only a sum's result can be thrown away
    with pytest.raises(ValueError, match=r"sum/drop to throw away the result of a sum, forward/oom to run out of "
                                         r"memory\). Received: '1:forward/drop'"):
        membership.dropped("forward", 1)
    monkeypatch.setattr(membership, "_PLAN", None)
    monkeypatch.setattr(membership, "_COUNTS", {})
    monkeypatch.setenv("MULTIGPU_FAULT", "0:forward/oom:2")
    assert [membership.out_of_memory(0) for _ in range(3)] == [False, True, False]
    assert not membership.out_of_memory(1)
    monkeypatch.setattr(membership, "_PLAN", None)
    monkeypatch.setattr(membership, "_COUNTS", {})
    monkeypatch.setenv("MULTIGPU_FAULT", "1:sum/drop:2")
    assert [membership.dropped("sum", 1) for _ in range(3)] == [False, True, False]
    membership.at("sum", 1)  # a drop kills nothing
    monkeypatch.setattr(membership, "_PLAN", None)


def test_the_members_record_round_trips(tmp_path):
    from multigpu import membership

    assert membership.read(tmp_path) is None
    record = membership.Members(2, (0, 2), ({"rank": 1, "device": "CPU:1", "why": "x", "at": 1.0},))
    membership.write(tmp_path, record)
    assert membership.read(tmp_path) == record
    assert membership.await_change(str(tmp_path), 1, 0.1) == record
    assert membership.await_change(str(tmp_path), 2, 0.05) is None
    assert "lost rank 1 (CPU:1); the run goes on with ranks [0, 2]" in str(membership.PeerLostError(record))


def test_after_a_loss_fixed_ratios_stay_and_automatic_shares_are_measured_once_more():
    from multigpu.balancing.balancer import BalanceOptions, LoadBalancer
    from multigpu.balancing.timing import StepRecord
    from multigpu.devices import parse_devices
    from multigpu.planning.shares import parse_ratios

    devices = parse_devices(["cpu:0", "cpu:1", "cpu:2"], num_gpus=lambda: 0)
    fixed = LoadBalancer(devices, 0, BalanceOptions(parse_ratios([1, 2, 5]), auto=False, rebalance=False),
                         print)
    fixed.drop([2])
    assert fixed.shares(48) == [16, 32, 0]
    lines = []
    auto = LoadBalancer(devices, 0, BalanceOptions(parse_ratios("auto"), auto=True, rebalance=True), lines.append)
    auto.ratios = [0.25, 0.25, 0.5]
    auto.drop([0])
    assert auto.shares(60) == [0, 20, 40]
    speeds = (0.0, 100.0, 300.0)  # device 1 is a third as fast as device 2 once device 0 is gone
    for _ in range(12):
        shares = auto.shares(60)
        times = tuple(n / v if v else 0.0 for n, v in zip(shares, speeds))
        auto.record(StepRecord((max(times),) * 3, (max(times),) * 3, times, tuple(shares)))
    assert auto.shares(60) == [0, 15, 45]
    assert lines[-1] == "measured the devices in the run: CPU:1 100 samples/s, CPU:2 300 samples/s -> shares 25%/75%"


def test_ranks_a_step_apart_take_the_state_of_the_first_one_ahead_and_others_end_the_run(monkeypatch):
    from types import SimpleNamespace

    from multigpu import failure
    from multigpu.backend.recovery import Recovery

    recovery = SimpleNamespace(comm=SimpleNamespace(members=[0, 1, 3]))

    def seen(*places):
        out = [None] * 4
        for r, (epoch, step, training, done) in zip([0, 1, 3], places):
            out[r] = {"at": (epoch, step, training), "done": [done]}
        return out

    assert Recovery._ahead(recovery, seen((1, 4, True, 14), (1, 4, True, 14), (1, 4, True, 14))) is None
    assert Recovery._ahead(recovery, seen((1, 4, True, 13), (1, 5, True, 14), (1, 5, True, 14))) == [1, 3]
    assert Recovery._ahead(recovery, seen((1, 5, True, 14), (1, 4, True, 13), (1, 4, True, 13))) == [0]
    said = []
    monkeypatch.setattr(failure, "fail", lambda reason: said.append(reason) or (_ for _ in ()).throw(SystemExit(1)))
    for places in [((1, 3, True, 12), (1, 5, True, 14), (1, 5, True, 14)),  # two steps apart
                   ((1, 9, True, 19), (1, 9, False, 20), (1, 9, False, 20)),  # ahead past the epoch's end
                   ((1, 4, True, 13), (1, 5, True, 14), (1, 4, True, 12))]:  # three places
        with pytest.raises(SystemExit):
            Recovery._ahead(recovery, seen(*places))
    assert said[0].startswith("the ranks left are at different places after losing a rank (rank 0: epoch 2, step 4, "
                              "updates [12]; rank 1: epoch 2, step 6, updates [14]; rank 3: epoch 2, step 6, updates "
                              "[14]): the lost rank's sum reached some of them only.")
    assert "rank 1: epoch 2, validation after step 10" in said[1]


def test_a_rank_counted_again_as_the_others_finish_is_ended_and_the_run_succeeds(tmp_path):
    """The supervisor counts a restarted rank among the members when it is ready; if the others finish before
    they form a group with it (it was ready at their last step), its wait for them ends with the run."""
    from multigpu.devices import Device
    from multigpu.runtime.supervisor import Supervisor

    class Proc:
        def __init__(self, code):
            self.code, self.killed = code, False

        def poll(self):
            return self.code

        def kill(self):
            self.killed, self.code = True, -9

        def wait(self):
            return self.code

    for welcomed in (False, True):
        group = Supervisor(["true"], [Device("cpu", i) for i in range(3)], 10.0)
        group.run_dir = str(tmp_path / str(welcomed))
        os.makedirs(group.run_dir)
        group.procs = [Proc(0), Proc(0), Proc(None)]
        group.admitted = {2: 3}  # counted again in generation 3
        if welcomed:
            (Path(group.run_dir) / "welcome-3").touch()  # the others formed the group with it: a member
        assert group.poll() == ((None, None) if welcomed else (0, None))
        assert group.procs[2].killed is not welcomed
        assert group.lost == ({} if welcomed else {2: "started again, but the run ended before it could rejoin"})
