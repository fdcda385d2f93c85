"""Automatic shares on real processes: a device throttled to half speed ends with the smaller share,
the result is kept in the profile, and the next run starts from it; a device set aside and taken back."""

import io
import json
import sys
import zipfile

import h5py
import numpy as np
import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def saved_arrays(path) -> dict:
    """Every array a ``.keras`` file holds (the weights, the optimizer's variables), by its path in the file."""
    with zipfile.ZipFile(path) as archive, h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as f:
        found = {}
        f.visititems(lambda name, item: found.update({name: np.asarray(item)}) if isinstance(item, h5py.Dataset)
                     else None)
    return found


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


def assert_batch_logs_are_one_devices(got: list, reference: list) -> None:
    """Rank 0's per-batch logs (its progress bar, its batch callbacks), also while it is set aside: one device's at
    that step or a later one of the same epoch (the device left's, relayed as it trains), never the last ones it
    took itself before."""
    assert [b[:3] for b in got] == [b[:3] for b in reference]
    for fit, epoch, batch, loss, accuracy in got:
        later = [b[3:] for b in reference if b[:2] == [fit, epoch] and b[2] >= batch]
        assert any(np.allclose([loss, accuracy], want, rtol=1e-5) for want in later), (fit, epoch, batch, loss)


@pytest.mark.parametrize(("backend", "kept", "remeasure"), [
    ("torch", 0, False), ("tensorflow", 0, False), ("jax", 0, False), ("torch", 1, False), ("tensorflow", 1, False),
    ("jax", 1, False), ("torch", 0, True), ("tensorflow", 1, True), ("tensorflow", 0, True), ("torch", 1, True),
    ("jax", 1, True)])
def test_a_device_set_aside_and_taken_back_leaves_the_result_one_devices(runner, backend, kept, remeasure):
    """MULTIGPU_PARK=force sets CPU:1 aside after each fit's first epoch (``force:1``: CPU:0, the leader, whose
    callbacks still see the weights trained on CPU:1 at every epoch's end): its epochs have no rows and no sum,
    the metrics stay global, and at a larger batch in the next fit it trains again: weights and logs equal one
    device's, every rank holds them.  ``remeasure``: measured again after one epoch aside (then two), the device
    comes back within the fit and is set aside again (the script's ``remeasure``)."""
    if backend == "tensorflow":
        pytest.importorskip("tensorflow", reason="the TensorFlow backend's tests need TensorFlow")
    out = runner.tmp_path / "two.json"
    park = "force" if kept == 0 else f"force:{kept}"
    env = {"KERAS_BACKEND": backend, "MULTIGPU_PARK": park, "TF_CPP_MIN_LOG_LEVEL": "2"}
    extra = ["remeasure"] if remeasure else []
    done = runner.together(([sys.executable, str(SCRIPTS / "parking.py"), str(runner.tmp_path / "one.json"), "one",
                             *extra], env),
                           ([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1",
                             str(SCRIPTS / "parking.py"), str(out), "two", *extra], env), timeout=240)
    for res in done:
        assert res.returncode == 0, res.stdout[-3000:]
    aside = 1 - kept
    said = f"CPU:{aside} set aside from epoch 2: MULTIGPU_PARK={park}"
    assert done[1].stdout.count(said) == 2, done[1].stdout[-3000:]
    if remeasure:  # aside in epochs 2, 4 and 5 of the first fit, back for epoch 3 and after epoch 5
        for line in (f"CPU:{aside} set aside from epoch 4: MULTIGPU_PARK={park}",
                     f"CPU:{aside} back after epoch 2 to be measured again: aside 1 epoch,",
                     f"CPU:{aside} back after epoch 5 to be measured again: aside 2 epochs,"):
            assert line in done[1].stdout, (line, done[1].stdout[-3000:])
    epochs = 7 if remeasure else 5
    one, two = np.load(f"{runner.tmp_path / 'one.json'}.rank0.npz"), np.load(f"{out}.rank0.npz")
    other = np.load(f"{out}.rank1.npz")
    for k in one.files:
        assert np.max(np.abs(one[k] - two[k])) <= 1e-5 * np.max(np.abs(one[k])), k
        assert np.array_equal(two[k], other[k]), k  # the device set aside took the weights back
    # what rank 0's callbacks saw at every epoch's end (saves, early stopping): one device's weights, also
    # while rank 0 itself was set aside
    seen, reference = np.load(f"{out}.rank0.epochs.npy"), np.load(f"{runner.tmp_path / 'one.json'}.rank0.epochs.npy")
    assert seen.shape == reference.shape == (epochs, reference.shape[1])
    for epoch, (got_weights, want) in enumerate(zip(seen, reference)):
        assert np.max(np.abs(got_weights - want)) <= 1e-5 * np.max(np.abs(want)), epoch
    # rank 0's ModelCheckpoint in the first fit's last epoch, aside since its second (remeasure: in its 4th, aside
    # again since then): weights and Adam's state
    last = 4 if remeasure else 3
    saved, wanted = (saved_arrays(f"{path}.fit64-epoch{last}.keras") for path in (out, runner.tmp_path / "one.json"))
    assert saved.keys() == wanted.keys() and any("optimizer" in k for k in saved), sorted(saved)
    for k, want in wanted.items():
        assert np.max(np.abs(saved[k] - want)) <= 1e-5 * max(np.max(np.abs(want)), 1e-30), k
    got = json.loads(out.read_text())
    reference = json.loads((runner.tmp_path / "one.json").read_text())
    for fit, fit_reference in zip(got["histories"], reference["histories"]):
        for key, values in fit_reference.items():
            np.testing.assert_allclose(fit[key], values, rtol=1e-5, err_msg=key)
    assert_batch_logs_are_one_devices(got["batches"], reference["batches"])
    for report in got["reports"]:  # each fit's last epoch: the device set aside had no rows, no time summing
        left, parked = report["devices"][kept], report["devices"][aside]
        assert parked["share"] == 0.0 and parked["samples"] == 0 and left["samples"] > 0, report
        assert left["sum"] == 0.0, report
    # Back with a share after the fit (its calibrated one: the one-device reference runs beside the calibration,
    # which it slows down, so the two equal devices' shares need not be near even).
    assert min(got["ratios"]) > 0.05, got["ratios"]
    # multigpu.state(model).aside at each epoch's end: the device set aside from each fit's second epoch, none
    # after the fits
    if remeasure:  # (each epoch's end runs the moves before the callbacks: back after epochs 2 and 5 of the first)
        assert got["aside"] == [[], [], [], [aside], [], [], []] and got["after"] == [], got["aside"]
    else:
        assert got["aside"] == [[], [aside], [aside], [], [aside]] and got["after"] == [], got["aside"]
    assert runner.leftovers() == []


@pytest.mark.parametrize(("backend", "left"), [("torch", (0, 1)), ("tensorflow", (1, 2)), ("jax", (0, 2))])
def test_devices_left_together_sum_among_themselves_and_the_result_stays_one_devices(runner, backend, left):
    """Three devices, one set aside after each fit's first epoch (``MULTIGPU_PARK=force:R,S``): the two left sum
    among themselves (a subgroup of gloo's, or their slots of the shared segment) and train as one device would;
    the device set aside, the leader among them where ``left`` leaves rank 0 out, holds the same weights at every
    epoch's end and after the fits, and the next fit at a larger batch takes every device back."""
    if backend == "tensorflow":
        pytest.importorskip("tensorflow", reason="the TensorFlow backend's tests need TensorFlow")
    if backend == "jax":
        pytest.importorskip("jax", reason="the JAX backend's tests need JAX")
    out = runner.tmp_path / "three.json"
    park = "force:" + ",".join(map(str, left))
    env = {"KERAS_BACKEND": backend, "MULTIGPU_PARK": park, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = runner.together(([sys.executable, str(SCRIPTS / "parking.py"), str(runner.tmp_path / "one.json"), "one"],
                            env),
                           ([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1,cpu:2",
                             str(SCRIPTS / "parking.py"), str(out), "three"], env), timeout=280)
    for res in done:
        assert res.returncode == 0, res.stdout[-3000:]
    aside = ({0, 1, 2} - set(left)).pop()
    said = f"CPU:{aside} set aside from epoch 2: MULTIGPU_PARK={park}"
    assert done[1].stdout.count(said) == 2, done[1].stdout[-3000:]
    # Float rounding: three partial sums instead of one pass over the batch; on TensorFlow one weight of 6,922
    # (a gradient near zero, which Adam's first steps divide by its own size) lands 1.5e-5 of the largest weight
    # away in the first epoch, all three devices together, and keeps that offset.
    tol = 3e-5
    one = np.load(f"{runner.tmp_path / 'one.json'}.rank0.npz")
    ranks = [np.load(f"{out}.rank{r}.npz") for r in range(3)]
    for k in one.files:
        assert np.max(np.abs(one[k] - ranks[0][k])) <= tol * np.max(np.abs(one[k])), k
        assert all(np.array_equal(ranks[0][k], other[k]) for other in ranks[1:]), k
    seen, reference = np.load(f"{out}.rank0.epochs.npy"), np.load(f"{runner.tmp_path / 'one.json'}.rank0.epochs.npy")
    assert seen.shape == reference.shape == (5, reference.shape[1])
    for epoch, (got_weights, want) in enumerate(zip(seen, reference)):
        assert np.max(np.abs(got_weights - want)) <= tol * np.max(np.abs(want)), epoch
    got = json.loads(out.read_text())
    reference = json.loads((runner.tmp_path / "one.json").read_text())
    for fit, fit_reference in zip(got["histories"], reference["histories"]):
        for key, values in fit_reference.items():
            np.testing.assert_allclose(fit[key], values, rtol=1e-5, err_msg=key)
    assert_batch_logs_are_one_devices(got["batches"], reference["batches"])
    for report in got["reports"]:  # each fit's last epoch: no rows on the device set aside, both left computed
        assert report["devices"][aside]["share"] == 0.0 and report["devices"][aside]["samples"] == 0, report
        assert all(report["devices"][r]["samples"] > 0 for r in left), report
    assert got["aside"] == [[], [aside], [aside], [], [aside]] and got["after"] == [], got["aside"]
    assert runner.leftovers() == []
