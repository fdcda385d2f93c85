"""The judgment that sets aside a device that does not pay (in-process: the moves run in test_balancing_run.py)."""

from types import SimpleNamespace

import pytest

from multigpu.balancing.parking import EPOCHS, MARGIN, REMEASURE, TRIAL_REACH, Parking
from multigpu.balancing.tally import EpochTally
from multigpu.balancing.timing import StepRecord

DEVICES = [SimpleNamespace(label="CPU:0"), SimpleNamespace(label="CPU:1")]


def epoch(samples, compute, wall, steps=10) -> dict:
    return {"samples": list(samples), "compute": list(compute), "wall": list(wall), "steps": steps}


def judged(*epochs, solo=None, allowed=True) -> Parking:
    lines = []
    p = Parking(DEVICES, lines.append)
    p.allowed = allowed
    p.begin_fit()
    for e in epochs:
        p.judge(e, 0, solo)
    p.lines = lines
    return p


def test_the_alone_estimate_splits_a_step_into_fixed_work_and_rows():
    # 10 steps of 32 + 32 rows; CPU:0 computed 0.1 s, half of it beyond its rows at its calibrated 6,400/s
    e = epoch([320, 320], [0.1, 0.1], [0.12, 0.12])
    assert Parking.alone_estimate(e, 0, [6400.0, 6400.0]) == pytest.approx(64 / (0.005 + 64 / 6400))
    # without calibration every second grows with the rows: the lower bound
    assert Parking.alone_estimate(e, 0, None) == pytest.approx(3200.0)


def test_a_device_that_pays_is_kept_and_one_that_does_not_is_set_aside_after_the_second_epoch():
    pays = epoch([320, 320], [0.1, 0.1], [0.08, 0.08])  # together 8,000/s; CPU:0 alone about 3,900/s, 5,000 at most
    p = judged(pays, pays, pays, solo=[5000.0, 5000.0])
    assert p.due == [] and p.together == pytest.approx(640 / 0.08)
    slow = epoch([600, 40], [0.1, 0.1], [0.4, 0.4])  # together 1,600/s (a slow device's waits); CPU:0 alone 6,000/s
    assert judged(slow).due == []  # the first epoch of a fit is not judged
    p = judged(slow, slow)
    assert EPOCHS == 2 and p.due == [1] and p.alone_speed >= MARGIN * p.together
    assert judged(slow, slow, allowed=False).due == []  # fixed ratios, JAX, sync_batchnorm: never
    # the slow device listed first: the second stays, the leader is set aside
    faster_second = epoch([40, 600], [0.1, 0.1], [0.4, 0.4])
    p = judged(faster_second, faster_second)
    assert p.due == [0] and p.kept == 1 and p.judgment["device"] == "CPU:1" and p.judgment["set_aside"] == ["CPU:0"]
    assert Parking.keeper(faster_second, 0, None) == 1 and Parking.keeper(slow, 0, None) == 0
    # two equal devices whose second measured a little faster: the leader alone is judged all the same
    even = epoch([320, 320], [0.1, 0.099], [0.4, 0.4])  # together 1,600/s; CPU:0 alone 3,200/s (no calibration)
    assert judged(even, even).due == [1] and Parking.keeper(even, 0, None) == 0
    # another device beats the leader by less than the margin: the leader; by more: the other
    assert Parking.keeper(epoch([320, 330], [0.1, 0.1], [0.4, 0.4]), 0, None) == 0
    assert Parking.keeper(epoch([320, 360], [0.1, 0.1], [0.4, 0.4]), 0, None) == 1
    # the judgment's figures, as multigpu.state(model) reports them: kept, then set aside
    kept = judged(pays, pays, solo=[5000.0, 5000.0]).judgment
    assert kept["pays"] and kept["set_aside"] == [] and kept["device"] == "CPU:0"
    assert kept["together"] == pytest.approx(8000.0, abs=0.1) and kept["alone"] < MARGIN * kept["together"]
    assert judged(slow, slow).judgment == {"device": "CPU:0", "alone": 6000.0, "ceiling": 6000.0, "together": 1600.0,
                                           "pays": False, "trial": False, "set_aside": ["CPU:1"]}
    assert judged(slow).judgment is None  # nothing judged yet


def test_where_the_estimate_and_its_ceiling_straddle_the_devices_together_they_are_set_aside_to_try():
    """TensorFlow's MLP at batch 64 on two equal cores: the fixed work measured together holds the host round trip
    of the sum, which a step alone does not make; the estimate (a floor) errs low, only a trial tells."""
    # 10 steps of 32 + 32 rows, 4 ms each (2.9 ms of it fixed at the calibrated 63 us a row), 5 ms of wall
    e = epoch([320, 320], [0.04, 0.04], [0.05, 0.05])
    p = judged(e, e, solo=[1 / 63e-6, 1 / 63e-6])
    j = p.judgment
    assert j["together"] == pytest.approx(12800.0) and j["ceiling"] == pytest.approx(15873.0, abs=1)
    assert j["alone"] < MARGIN * j["together"] <= MARGIN * j["ceiling"]  # the floor alone would keep both
    assert j["trial"] and not j["pays"] and p.due == [1] and j["set_aside"] == ["CPU:1"]
    p.park([0.5, 0.5], epoch=2)
    assert "CPU:1 set aside from epoch 3: to try CPU:0 alone, which would compute" in p.lines[-1]
    assert f"{j['alone']:.0f} to 15873 samples/s" in p.lines[-1]
    # the trial lost: back, and the judgment says they pay, with what alone ran
    p.observe(StepRecord(wall=(0.01, 0.0), step=(0.01, 0.0), compute=(0.01, 0.0), samples=(64, 0)))
    assert not p.keeps_aside()
    p.back(epoch=2)
    assert p.judgment["pays"] and p.judgment["set_aside"] == [] and p.judgment["alone_ran"] == 6400.0
    # the ceiling errs low too (a pass of 32 rows costs more per row than one of 64): a trial where it reaches
    # TRIAL_REACH of the devices together; below that, or where it falls far short, no trial: kept
    for wall, trial in ((0.0376, True), (0.0346, False), (0.025, False)):  # together 17,021, 18,497, 25,600/s
        e = epoch([320, 320], [0.04, 0.04], [wall, wall])
        k = judged(e, e, solo=[1 / 63e-6, 1 / 63e-6]).judgment
        assert (k["ceiling"] >= TRIAL_REACH * k["together"]) == trial, (wall, k)
        assert k["trial"] == trial and k["pays"] == (not trial) and k["set_aside"] == (["CPU:1"] if trial else [])


def test_a_new_sizes_first_step_counts_neither_for_the_devices_together_nor_for_one_alone():
    """TensorFlow's GRU at batch 256 on ``cpu:0`` + ``cpu:1@0.5`` (issue 65): an epoch of 48 steps of 50 ms, one of
    which traced new sizes for a second. Judged with that second, the two devices read 3,670 samples/s, below what
    CPU:0's ceiling alone reached, and a trial set CPU:1 aside for the rest of the fit, where fixed 2.5:1 ran
    5,000 to 6,000 samples/s; judged on their steady steps they pay, and no trial is made."""
    tally = EpochTally(2)
    tally.add(StepRecord((1.0, 1.0), (1.0, 1.0), (0.9, 0.9), (176, 80)), first_use=True)
    for _ in range(47):
        tally.add(StepRecord((0.05, 0.05), (0.05, 0.05), (0.045, 0.042), (180, 76)))
    with_trace, steady = dict(tally.totals), tally.steady()
    assert with_trace["steps"] == 48 and steady["steps"] == 47 and steady["samples"] == [180 * 47, 76 * 47]
    assert sum(steady["samples"]) / max(steady["wall"]) == pytest.approx(5120.0)
    assert sum(with_trace["samples"]) / max(with_trace["wall"]) < 3700
    solo = [4300.0, 1800.0]
    assert judged(with_trace, with_trace, solo=solo).judgment["trial"]  # what the trace made of it
    kept = judged(steady, steady, solo=solo)
    assert kept.due == [] and kept.judgment["pays"] and kept.together == pytest.approx(5120.0)
    # a trial alone does not count its own first step at the whole batch either
    p = judged(with_trace, with_trace, solo=solo)
    p.park([0.7, 0.3], epoch=2)
    p.observe(StepRecord((1.2, 0.0), (1.2, 0.0), (1.2, 0.0), (256, 0)), first_use=True)
    for _ in range(47):
        p.observe(StepRecord((0.06, 0.0), (0.06, 0.0), (0.06, 0.0), (256, 0)))
    assert p.alone == pytest.approx(256 / 0.06) and p.keeps_aside()  # against the traced 3,670: kept aside
    p.together = kept.together
    assert not p.keeps_aside()  # against the steady 5,120: back
    # the rank left's totals taken on every rank while the others are aside: the same everywhere, told apart nowhere
    tally.take(dict(with_trace))
    assert tally.steady() == with_trace


def test_multigpu_bench_names_the_devices_that_pay_from_its_epoch_report():
    """``multigpu bench`` judges its run's epoch as automatic shares do (the same :meth:`Parking.verdict`)."""
    from multigpu.cli.bench import _who_pays

    def run(samples, compute, per_second):
        return {"report": {"devices": [
            {"device": d.label, "samples": s, "compute": c, "steps": 10, "samples_per_second": v,
             "compute_samples_per_second": s / c} for d, s, c, v in zip(DEVICES, samples, compute, per_second)]}}

    line, verdict = _who_pays(run([600, 40], [0.1, 0.1], [1500.0, 100.0]))  # a slow device's waits: 0.4 s
    assert not verdict["pays"] and verdict["alone"] == 6000.0 and verdict["together"] == 1600.0
    assert line.startswith("which devices pay: CPU:0 alone (CPU:1 does not): it would compute about 6000 samples/s")
    line, verdict = _who_pays(run([320, 320], [0.1, 0.1], [2666.7, 2666.7]))
    assert verdict["pays"] and line.startswith("which devices pay: all of them (CPU:0 alone would compute about 3200")
    # between the together figure and 10% above it: a trial
    line, verdict = _who_pays(run([320, 320], [0.1, 0.1], [1500.0, 1500.0]))
    assert verdict["trial"] and not verdict["pays"]
    assert line.startswith("which devices pay: perhaps CPU:0 alone: it would compute about 3200 samples/s")
    assert "sets CPU:1 aside from its second epoch to try" in line
    assert _who_pays({"report": None}) is None


def test_aside_the_shares_move_and_the_trial_decides_the_return(monkeypatch):
    slow = epoch([600, 40], [0.1, 0.1], [0.4, 0.4])
    p = judged(slow, slow)
    assert p.park([0.9, 0.1], epoch=2) == [0.9, 0.0] and p.parked == [1] and p.due == []
    said = "CPU:1 set aside from epoch 3: CPU:0 alone computes 6000 samples/s where the 2 devices ran 1600"
    assert said in p.lines[-1]
    p.judge(slow, 0)  # no judgment while aside
    assert p.due == [] and p.keeps_aside()  # nothing measured alone yet: kept
    p.observe(StepRecord(wall=(0.02, 0.0), step=(0.02, 0.0), compute=(0.02, 0.0), samples=(64, 0)))
    assert p.alone == pytest.approx(3200.0) and p.keeps_aside()
    p.observe(StepRecord(wall=(0.2, 0.0), step=(0.2, 0.0), compute=(0.2, 0.0), samples=(64, 0)))
    assert not p.keeps_aside()  # 582/s alone against 1,600 together: back
    assert p.back(epoch=2) == [0.9, 0.1] and p.parked == []
    assert "CPU:1 back after epoch 3: alone ran 582 samples/s, less than the 1600 together" in p.lines[-1]
    p.judge(slow, 0)
    assert p.due == []  # tried once in this fit
    p.begin_fit()
    p.judge(slow, 0)
    p.judge(slow, 0)
    assert p.due == [1]  # a new fit judges again


def test_devices_set_aside_are_measured_again_after_some_epochs_then_twice_as_late():
    slow = epoch([600, 40], [0.1, 0.1], [0.4, 0.4])
    p = judged(slow, slow)
    p.park([0.9, 0.1], epoch=2)
    p.observe(StepRecord(wall=(0.02, 0.0), step=(0.02, 0.0), compute=(0.02, 0.0), samples=(64, 0)))
    ends = [p.keeps_aside() and p.remeasure_due() for _ in range(REMEASURE)]
    assert ends == [False] * (REMEASURE - 1) + [True]  # aside REMEASURE epochs: back to be measured
    assert p.back(epoch=2 + REMEASURE, again=True) == [0.9, 0.1] and p.parked == []
    assert (f"CPU:1 back after epoch {3 + REMEASURE} to be measured again: aside {REMEASURE} epochs, alone ran "
            "3200 samples/s where the 2 devices ran 1600 together before") in p.lines[-1]
    faster = epoch([600, 300], [0.1, 0.1], [0.1, 0.1])  # together now 9,000/s, CPU:0 alone 6,000 at most
    p.judge(faster, 0)
    assert p.due == [] and p.together == pytest.approx(900 / 0.1)  # judged on the new figure: they pay
    p.judge(epoch([600, 40], [0.01, 0.1], [0.4, 0.4]), 0)  # CPU:0 alone 60,000/s: set aside again
    assert p.due == [1]
    p.park([0.9, 0.1], epoch=20)
    ends = [p.remeasure_due() for _ in range(2 * REMEASURE)]
    assert ends.index(True) == 2 * REMEASURE - 1  # the next measurement comes twice as late
    p.back(None)
    p.begin_fit()
    assert p.period == REMEASURE  # each fit starts at REMEASURE again


def test_the_testing_aid_forces_the_move_or_none(monkeypatch):
    even = epoch([320, 320], [0.1, 0.1], [0.12, 0.12])
    monkeypatch.setenv("MULTIGPU_PARK", "force")
    assert judged(even).due == [1]
    monkeypatch.setenv("MULTIGPU_PARK", "force:1")
    forced = judged(even)
    assert forced.due == [0] and forced.kept == 1
    assert forced.park([1.0, 1.0], epoch=1) == [0.0, 1.0]
    assert "CPU:0 set aside from epoch 2: MULTIGPU_PARK=force:1" in forced.lines[-1]
    monkeypatch.setenv("MULTIGPU_PARK", "off")
    slow = epoch([600, 40], [0.1, 0.1], [0.4, 0.4])
    assert judged(slow, slow).due == []
    # a rank this run does not have, a misspelling, every rank kept, a rank twice: said at once
    for wrong in ("force:2", "force:x", "forse", "force:0,1", "force:1,1", "force:"):
        monkeypatch.setenv("MULTIGPU_PARK", wrong)
        with pytest.raises(ValueError, match=rf"must be 'force', 'force:R' or 'force:R,S,...' with R, S, ... distinct "
                                             rf"ranks of this run \(0 to 1\), not all of them, or 'off'. Received: "
                                             rf"MULTIGPU_PARK='{wrong}'"):
            Parking(DEVICES, print)


THREE = [SimpleNamespace(label="CPU:0"), SimpleNamespace(label="CPU:1"), SimpleNamespace(label="CPU:2@0.1")]
# 10 steps of 30 + 30 + 4 rows: CPU:0 and CPU:1 calibrated at 6,000 samples/s, CPU:2@0.1 at 600; each computed 0.1 s
# (5 ms a step of fixed work on the fast ones), the sums took 5 ms a step, the steps 40 ms (the slow one's waits)
SLOW_THIRD = {"samples": [300, 300, 40], "compute": [0.1, 0.1, 0.1], "wall": [0.4, 0.4, 0.4], "steps": 10,
              "sum": 0.05}
SOLO = [6000.0, 6000.0, 600.0]


def judged_three(e, groups=True) -> Parking:
    lines = []
    p = Parking(THREE, lines.append)
    p.allowed, p.groups = True, groups
    p.begin_fit()
    for _ in range(EPOCHS):
        p.judge(e, 0, SOLO)
    p.lines = lines
    return p


def test_the_devices_that_pay_stay_together_and_the_one_that_does_not_is_set_aside():
    # CPU:0 and CPU:1 without CPU:2: each its fixed work (5 ms) and rows at 6,000/s, finishing together at T with
    # (T - 5 ms) * 12,000 = 64 rows, and the sum's 5 ms at the pace of a device ten times as fast as CPU:2@0.1
    finish = (64 + 2 * 0.005 * 6000) / 12000
    pair = 64 / (finish + 0.0005)
    # the pace of the slowest device in the group: with CPU:2@0.1 in it, the whole sum
    assert Parking.group_estimate(SLOW_THIRD, [0, 2], SOLO) < Parking.group_estimate(SLOW_THIRD, [0, 1], SOLO)
    assert Parking.group_estimate(SLOW_THIRD, [0, 1], SOLO) == pytest.approx(pair)
    assert Parking.best_group(SLOW_THIRD, SOLO) == ([0, 1], pytest.approx(pair))
    alone = Parking.alone_estimate(SLOW_THIRD, 0, SOLO)
    assert alone == pytest.approx(64 / (0.005 + 64 / 6000)) and alone < pair  # one fast device alone: less
    p = judged_three(SLOW_THIRD)
    assert p.due == [2] and p.left == [0, 1] and p.kept == 0
    assert p.judgment["devices"] == ["CPU:0", "CPU:1"] and p.judgment["set_aside"] == ["CPU:2@0.1"]
    assert p.judgment["alone"] == pytest.approx(pair, abs=0.1) and not p.judgment["pays"]
    assert p.park([1.0, 1.0, 0.1], epoch=2) == [1.0, 1.0, 0.0]
    assert p.lines[-1] == (f"CPU:2@0.1 set aside from epoch 3: CPU:0, CPU:1 without them would compute {pair:.0f} "
                           "samples/s where the 3 devices ran 1600 together (the sums and waits cost more than they "
                           "add); back at the next fit(), or at this epoch's end if the devices left run slower")
    p.observe(StepRecord(samples=[32, 32, 0], wall=[0.02, 0.02, 0.0], step=[0.02, 0.02, 0.0],
                         compute=[0.015, 0.015, 0.0]))
    assert p.keeps_aside()  # 3,200 samples/s, more than 1,600 together
    assert p.back(3) == [1.0, 1.0, 0.1] and p.left == [] and p.kept is None
    assert "CPU:2@0.1 back after epoch 4: the devices left ran 3200 samples/s" in p.lines[-1]
    # where the steps cannot sum over part of the ranks (JAX's XLA sums): one device alone, as with two
    p = judged_three(SLOW_THIRD, groups=False)
    assert p.due == [1, 2] and p.left == [0]
    # all three pay: the slow one's waits gone, the three together run 8,000 samples/s (one alone: 6,000 at most)
    quick = dict(SLOW_THIRD, wall=[0.08, 0.08, 0.08])
    assert judged_three(quick).due == []


def test_the_testing_aid_keeps_several_devices(monkeypatch):
    monkeypatch.setenv("MULTIGPU_PARK", "force:1,0")
    p = judged_three(SLOW_THIRD, groups=True)
    assert p.due == [2] and p.left == [0, 1] and p.kept == 0
    p.park([1.0, 1.0, 1.0], epoch=1)
    assert "CPU:2@0.1 set aside from epoch 2: MULTIGPU_PARK=force:1,0;" in p.lines[-1]


def test_bench_advice_names_the_group_that_pays():
    from multigpu.cli.bench import _who_pays

    rows = [{"device": d.label, "samples": s, "compute": 0.1, "steps": 10, "samples_per_second": s / 0.4, "sum": 0.05}
            for d, s in zip(THREE, [300, 300, 40])]
    line, verdict = _who_pays({"report": {"devices": rows}})
    # no calibration: every second of a step grows with its rows (3,000 and 400 samples/s), the sum at that pace
    pair = 64 / (64 / 6000 + 0.005 * 400 / 3000)
    assert verdict["devices"] == ["CPU:0", "CPU:1"] and verdict["alone"] == pytest.approx(pair, abs=0.1)
    assert line.startswith(f"which devices pay: CPU:0, CPU:1 (CPU:2@0.1 does not): without the rest they would "
                           f"compute about {pair:.0f} samples/s at this batch, at least 1.1x the 1600 the devices ran "
                           "together")


class _Board:
    """A run's store for the logs relay, in-process (``post`` and ``peek``)."""

    def __init__(self) -> None:
        self.runtime = SimpleNamespace(timeout=5.0)
        self.board = {}

    def post(self, key, obj) -> None:
        self.board[key] = obj

    def peek(self, key):
        return self.board.get(key)


def test_the_relay_sends_the_logs_of_a_step_and_names_a_log_it_cannot_send():
    import threading

    import numpy as np

    from multigpu.backend.parking import LogsRelay

    board = _Board()
    left, leader = LogsRelay(board), LogsRelay(board)
    leader._name = left._name  # the same model's relay on two ranks
    for relay in (left, leader):
        relay.epoch_begins()
    left.offer(0, {"loss": np.float32(0.5), "parts": np.arange(3.0)})
    left.flush()
    got = leader.logs_for(0)
    assert got["loss"] == 0.5 and type(got["loss"]) is float and got["parts"].tolist() == [0.0, 1.0, 2.0]
    # a value the relay cannot copy: the leader's wait names it at once, where it timed out before
    left.offer(1, {"loss": 0.25, "lock": threading.Lock()})
    left.flush()
    with pytest.raises(TypeError, match=r"logs of step 1 could not be sent to rank 0 \(TypeError: .*lock"):
        leader.logs_for(1)
