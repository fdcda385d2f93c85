"""The load balancer in one process: the one owner of the shares, fed shared step records."""

import json
import time

import pytest

from multigpu.balancing import BalanceOptions, LoadBalancer, StepRecord, StepTiming
from multigpu.balancing.profiles import ProfileError, read_profile, write_profile
from multigpu.devices import Device
from multigpu.planning import parse_ratios

DEVICES = [Device("cpu", 0, 1.0, (0,)), Device("cpu", 1, 0.5, (1,))]


def make(spec="auto", rebalance=True, profile=None, announced=False, **kw):
    """A balancer and the lines it logs (without the run's first line, naming its devices, unless
    ``announced``)."""
    lines = []
    options = BalanceOptions(parse_ratios(spec), auto=spec in ("auto", None), rebalance=rebalance,
                             profile=None if profile is None else str(profile), **kw)

    def log(line: str) -> None:
        if announced or not line.startswith(f"{len(DEVICES)} devices ("):
            lines.append(line)
    return LoadBalancer(DEVICES, 0, options, log), lines


def test_the_first_fit_names_the_devices_and_the_split_once():
    fixed, lines = make("3,1", rebalance=False, announced=True)
    fixed.begin_fit(256, lambda: "sig")
    fixed.begin_fit(128, lambda: "sig")
    assert lines == ["2 devices (CPU:0, CPU:1@0.5), shares 75%/25% (192 + 64 rows of each batch of 256), "
                     "by ratios 3:1"]
    auto, lines = make("auto", announced=True)
    auto.begin_fit(None, lambda: "sig")
    assert lines == ["2 devices (CPU:0, CPU:1@0.5); measuring each device at the first step, then searching "
                     "the shares"]


def feed(balancer, speeds, steps, batch=128, overhead=0.0):
    """Steps at the balancer's current shares on devices of the given true speeds."""
    for _ in range(steps):
        shares = balancer.shares(batch)
        balancer.planner.plan(batch)
        balancer.planner.take(shares[0])
        times = [b / s for b, s in zip(shares, speeds)]
        step = max(times) + overhead
        balancer.record(StepRecord((step, step), (step, step), tuple(times), tuple(shares)))


def test_fixed_ratios_are_the_shares_and_nothing_moves_them():
    b, lines = make("3,1", rebalance=False)
    assert b.shares(256) == [192, 64] and b.calibrated
    b.begin_fit(256, lambda: "sig")
    feed(b, (100, 100), 50)
    assert b.shares(256) == [192, 64] and not lines
    assert b.describe() == "multigpu: 2 device(s): CPU:0 75%, CPU:1@0.5 25%"


def test_a_grid_keeps_automatic_shares_on_a_few_sizes_and_leaves_fixed_ones_alone():
    b, _ = make("auto", grid=16)
    b.begin_fit(256, lambda: "sig")
    b.calibrate(lambda: (1.0, 0.0), lambda v: [v[0], 0.47, *v[2:]], 10)  # speeds 1 : 0.47 -> 68% / 32%
    assert b.shares(256) == [176, 80] and b.shares(100) == [68, 32]  # units of 16, the remainder to CPU:0
    feed(b, (200, 94), 300, batch=256)
    assert b.search.settled and all(s % 16 == 0 for s in b.shares(256))
    fixed, _ = make("7,3", grid=16)
    fixed.begin_fit(256, lambda: "sig")
    assert fixed.shares(256) == [179, 77]


def test_calibration_sets_shares_from_solo_speeds_and_writes_the_profile(tmp_path):
    profile = tmp_path / "p.json"
    b, lines = make(profile=profile)
    b.begin_fit(128, lambda: "sig")
    assert not b.calibrated
    b.calibrate(lambda: (300.0, 0.5), lambda v: [v[0], 150.0, v[2], 0.7], steps_per_epoch=100)
    assert b.shares(128) == [85, 43]
    assert lines[0].startswith("calibrated in 0.7 s (") and "CPU:0 300 samples/s, CPU:1@0.5 150 samples/s" in lines[0]
    assert lines[0].endswith("-> shares 67%/33%")
    b.end_epoch(0)
    entry = read_profile(profile, None)
    assert entry["devices"] == ["cpu:0", "cpu:1@0.5"] and entry["speeds"] == [300.0, 150.0]
    # The next run starts from the profile: no calibration.
    again, lines = make(profile=profile)
    again.begin_fit(128, lambda: "sig")
    assert again.calibrated and again.shares(128) == [85, 43]
    assert lines == [f"shares 67%/33% from the profile {profile}"]


def test_a_broken_profile_warns_and_falls_back_to_calibrating(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text("{broken")
    b, _ = make(profile=profile)
    with pytest.warns(UserWarning, match="cannot use the profile .*not valid JSON.*calibrating instead"):
        b.begin_fit(128, lambda: "sig")
    assert not b.calibrated


def test_records_move_the_shares_to_the_fastest_measured_and_log_each_move():
    b, lines = make("1,1")
    b.options.auto = True
    b.begin_fit(128, lambda: "sig", steps_per_epoch=100)  # two epochs for the search from 1:1, uncalibrated
    feed(b, (200, 100), 200)
    assert abs(b.shares(128)[0] - 85) <= 3, b.shares(128)
    kept = [line for line in lines if line.endswith(", kept")]
    assert kept and all("samples/s against" in line for line in kept)
    assert any(line.startswith("shares settled at") for line in lines)
    report = b.end_epoch(0)
    assert [row["device"] for row in report["devices"]] == ["CPU:0", "CPU:1@0.5"]
    assert report["devices"][0]["samples"] + report["devices"][1]["samples"] == 128 * 200


def test_ragged_steps_and_steps_at_old_shares_do_not_count():
    b, _ = make("1,1")
    b.begin_fit(128, lambda: "sig")
    for _ in range(40):
        b.record(StepRecord((1.0, 1.0), (1.0, 1.0), (0.5, 1.0), (60, 61)))  # not this batch's shares
    assert b.search.shares() == [64, 64] and b._window.steps == 0


def test_the_first_step_at_new_local_batch_sizes_is_not_timed_and_later_ones_are():
    """A new size's first step pays its first use (kernels' plans, buffers, a recording): not a measure of the
    shares; a size seen before is timed from its first step."""
    b, _ = make("1,1")
    b.begin_fit(128, lambda: "sig")
    b.record(StepRecord((9.0, 9.0), (9.0, 9.0), (9.0, 9.0), (64, 64)))  # the first step at 64/64: slow, skipped
    assert b._window.steps == 0
    b.record(StepRecord((1.0, 1.0), (1.0, 1.0), (0.5, 1.0), (64, 64)))
    assert b._window.steps == 1 and b._window.seconds == 1.0
    b.record(StepRecord((1.0, 1.0), (1.0, 1.0), (0.5, 1.0), (60, 68)))  # elsewhere: the window starts again
    b.record(StepRecord((1.0, 1.0), (1.0, 1.0), (0.5, 1.0), (64, 64)))  # back at a warm size: timed at once
    assert b._window.steps == 1
    # the epoch's report counts every step; the judgment of the devices that pay, the steps at sizes run before
    assert b.tally.totals["steps"] == 4 and b.tally.steady()["steps"] == 2
    assert b.tally.steady()["wall"] == [2.0, 2.0]


def test_it_says_once_when_the_devices_together_are_slower_than_the_fastest_alone():
    b, lines = make()
    b.begin_fit(64, lambda: "sig")
    b.calibrate(lambda: (4000.0, 0.1), lambda v: [v[0], 2000.0, 0.1, 0.1], steps_per_epoch=10)
    feed(b, (4000, 2000), 1500, batch=64, overhead=0.02)  # a 20 ms per-step cost: slower than one device
    said = [line for line in lines if "less than CPU:0 alone" in line]
    assert len(said) == 1, lines
    assert "at a global batch of 64 the 2 devices together run" in said[0]
    assert "from a global batch of about" in said[0] and "they would pay" in said[0]


def test_step_timing_reports_the_previous_step_in_its_slots():
    t = StepTiming(rank=1, world_size=2)
    assert t.vector() == [0.0] * 10
    t.begin()
    with t.waiting():
        pass
    t.end(samples=16)
    vec = t.vector()
    assert vec[1] > 0 and vec[0] == 0.0 and vec[7] == 16.0  # wall, step, compute, samples, input: rank 1's slots
    assert t.vector() == [0.0] * 10  # sent once
    rec = StepRecord.from_vector([0.2, 0.3, 0.2, 0.3, 0.1, 0.2, 48, 16, 0.05, 0.0], 2)
    assert rec.samples == (48, 16) and rec.compute == (0.1, 0.2) and rec.input == (0.05, 0.0)
    assert StepRecord.from_vector([0.0] * 10, 2) is None


def test_the_input_wait_is_the_time_between_steps_spent_waiting_for_the_batch():
    t = StepTiming(rank=0, world_size=1)
    t.begin()
    t.end(samples=8)
    t.vector()
    time.sleep(0.05)
    t.note_input(0.03)  # the loop waited 30 ms of the 50 ms between the steps for its batch
    t.begin()
    t.end(samples=8)
    wall, step, _, _, waited = t.vector()
    assert waited == pytest.approx(0.03) and wall - step >= 0.05


def test_a_discarded_step_is_no_measurement_for_any_rank():
    """A step that compiled (JAX) is discarded on its rank: with ``complete`` the whole step is dropped."""
    t = StepTiming(rank=0, world_size=2)
    t.begin()
    t.end(samples=48)
    t.discard()
    mine = t.vector()
    assert mine == [0.0] * 10
    other = [0.0, 0.3, 0.0, 0.3, 0.0, 0.2, 0.0, 16.0, 0.0, 0.0]  # rank 1 measured its step
    summed = [a + b for a, b in zip(mine, other)]
    assert StepRecord.from_vector(summed, 2, complete=True) is None
    assert StepRecord.from_vector(summed, 2).samples == (0, 16)  # without `complete`, the torch path's reading
    t.begin()
    t.end(samples=48)  # the next step counts again
    assert StepRecord.from_vector([a + b for a, b in zip(t.vector(), other)], 2, complete=True).samples == (48, 16)


def test_profile_round_trip_and_bad_profiles(tmp_path):
    path = tmp_path / "p.json"
    entry = {"devices": ["cpu:0", "cpu:1@0.5"], "speeds": [400.0, 200.0], "ratios": [0.667, 0.333]}
    write_profile(path, "abc@cpu:0,cpu:1@0.5", entry)
    assert read_profile(path, "abc@cpu:0,cpu:1@0.5", ["cpu:0", "cpu:1@0.5"]) == entry
    assert read_profile(path) == entry
    write_profile(path, "def@cpu:0,cpu:1", {**entry, "devices": ["cpu:0", "cpu:1"]})
    with pytest.raises(ProfileError) as two:  # `ratios=PATH` takes one entry: the message says how to choose
        read_profile(path)
    assert "has 2 entries (devices: cpu:0,cpu:1@0.5; cpu:0,cpu:1)" in str(two.value)
    assert f'`ratios="auto", profile="{path}"`' in str(two.value) and "`ratios=[3, 1]`" in str(two.value)
    assert "multigpu calibrate --profile NEW.json" in str(two.value)
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


def test_a_scan_point_far_from_the_best_is_no_reason_to_say_the_devices_do_not_pay():
    """The opening scan tries shares far from the best: a slow window there is the scan's, not the devices'."""
    b, lines = make()
    b.begin_fit(256, lambda: "sig")
    b.calibrate(lambda: (1000.0, 0.1), lambda v: [v[0], 500.0, 0.1, 0.1], steps_per_epoch=10)
    # Together the devices run near 1,500 samples/s at the best shares, and under 900 (less than
    # CPU:0 alone) at shares far from them, as the scan's points are.
    feed(b, (1000, 500), 400, batch=256, overhead=0.002)
    assert any("scanning" in line for line in lines), lines
    assert not any("less than CPU:0 alone" in line for line in lines), lines


def test_waiting_for_input_is_reported_per_device_and_said_once_when_it_holds_the_run_back():
    b, lines = make("1,1", rebalance=False, report=True)
    b.begin_fit(128, lambda: "sig")
    for _ in range(4):  # 0.1 s between steps, 0.06 s of it waiting for the batch on rank 0
        b.record(StepRecord((0.2, 0.2), (0.1, 0.1), (0.1, 0.1), (64, 64), (0.06, 0.0)))
    report = b.end_epoch(0)
    assert [round(r["input"], 2) for r in report["devices"]] == [0.24, 0.0]
    assert "input" in lines[0] and "30%" in lines[0].splitlines()[2]  # the table: CPU:0 waited 30% for input
    assert [ln for ln in lines if "the input holds the run back" in ln] == [
        lines[1]] and "CPU:0 30%, CPU:1@0.5 0%" in lines[1]
    for _ in range(4):
        b.record(StepRecord((0.2, 0.2), (0.1, 0.1), (0.1, 0.1), (64, 64), (0.06, 0.0)))
    b.end_epoch(1)
    assert sum("the input holds the run back" in ln for ln in lines) == 1  # said once


def test_the_profile_keeps_the_kept_shares_never_a_probe_the_search_is_trying(tmp_path):
    profile = tmp_path / "p.json"
    b, _ = make(profile=profile)
    b.begin_fit(128, lambda: "sig")
    b.calibrate(lambda: (300.0, 0.5), lambda v: [v[0], 150.0, v[2], 0.7], steps_per_epoch=100)
    kept = b.search.base
    for _ in range(200):  # until the search is measuring a probe away from the kept shares
        feed(b, (300, 150), 1)
        if tuple(b.search.ratios) != tuple(b.search.base):
            break
    assert tuple(b.search.ratios) != tuple(b.search.base), "the search never tried other shares"
    probe, kept = list(b.ratios), b.search.base
    b.end_epoch(0)
    saved = read_profile(profile, None)["ratios"]
    assert saved == pytest.approx(list(kept)) and saved != pytest.approx(probe)


def test_the_report_tells_the_gradient_sum_from_waiting_for_a_slower_device_and_suggests_compression_once():
    b, lines = make("1,1", rebalance=False, report=True)
    b.begin_fit(128, lambda: "sig")
    for _ in range(4):  # steps of 1 s: CPU:0 computes 0.3 s and waits 0.7, CPU:1 computes 0.5 and waits 0.5
        b.record(StepRecord((1.0, 1.0), (1.0, 1.0), (0.3, 0.5), (64, 64)))
    report = b.end_epoch(0)
    # The device that reached the sum last (CPU:1) waited 0.5 s a step for the sum alone: the link's time.
    assert [round(r["sum"], 2) for r in report["devices"]] == [2.0, 2.0]
    assert [round(r["wait"] - r["sum"], 2) for r in report["devices"]] == [0.8, 0.0]  # waiting for CPU:1
    row = lines[0].splitlines()[2].split()
    assert row[-3:-1] == ["50%", "20%"]  # CPU:0: sum 50%, waiting 20%
    assert [ln for ln in lines if "the link holds the run back" in ln] == [lines[1]]
    assert "compression='bf16'" in lines[1] and "50%" in lines[1]
    for _ in range(4):
        b.record(StepRecord((1.0, 1.0), (1.0, 1.0), (0.3, 0.5), (64, 64)))
    b.end_epoch(1)
    assert sum("the link holds the run back" in ln for ln in lines) == 1  # said once
    compressed, said = make("1,1", rebalance=False, compression="bf16")
    compressed.begin_fit(128, lambda: "sig")
    compressed.record(StepRecord((1.0, 1.0), (1.0, 1.0), (0.3, 0.5), (64, 64)))
    compressed.end_epoch(0)
    assert not any("the link holds the run back" in ln for ln in said)  # already compressed: nothing to suggest


def test_the_search_settles_within_two_epochs_or_40_steps_and_a_later_fit_keeps_its_shares():
    """On devices whose windows never agree, the search still stops moving: after two epochs (or 40 steps,
    whichever is longer) it settles on the shares kept so far, and a later fit at another batch size starts
    settled at them (no scan, no probe), watching the throughput like any settled shares."""
    b, lines = make("1,1")
    b.options.auto = True
    b.begin_fit(128, lambda: "sig", steps_per_epoch=16)
    speeds = [(200, 100), (120, 160)]  # the devices swap speeds every few steps: noise the search cannot settle
    steps = 0
    while not b.search.settled:
        feed(b, speeds[(steps // 4) % 2], 1)
        steps += 1
        assert steps <= 60, lines
    assert steps == 40  # the search's last move is within the first 40 steps of the fit
    assert any(f"after {steps} steps the search stops moving" in line for line in lines), lines
    kept = list(b.search.base)
    assert b.ratios == pytest.approx(kept)
    b.begin_fit(256, lambda: "sig", steps_per_epoch=8)
    assert b.search.batch_size == 256 and b.search.settled and b.search.phase == "settled"
    before = len(lines)
    feed(b, (200, 100), 30, batch=256)
    assert b.ratios == pytest.approx(kept)
    assert not any("scanning" in line or "kept" in line for line in lines[before:]), lines[before:]


def test_a_profile_entry_belongs_to_one_keras_backend(monkeypatch):
    """The same model on the same devices computes at other speeds on another backend: its entry is its own."""
    import keras

    from multigpu import env
    from multigpu.balancing.profiles import model_signature

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    here = model_signature(model)
    assert model_signature(model) == here
    monkeypatch.setattr(env, "keras_backend", lambda: "tensorflow-elsewhere")
    assert model_signature(model) != here
