"""Host memory: the data once per machine (``multigpu.load_once``), a supervisor that gives back what the script
loaded, and memory-mapped arrays read a batch's rows at a time."""

from __future__ import annotations

import json
import os
import re
import socket
import sys

import numpy as np
import pytest

from multigpu.runtime import load_once as once
from tests.conftest import SCRIPTS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_structure_round_trips_through_one_shared_file():
    """Arrays in any nesting of tuples, lists and dicts come back read-only and equal; other values as they were."""
    value = {"a": np.arange(10, dtype=np.int16), "b": [np.ones((3, 2), np.float64), ("text", 7)],
             "c": (np.zeros(0, np.float32), {"d": np.array([b"xy", b"z"])})}
    fd = once._write(value)
    try:
        got = once._read(fd)
    finally:
        os.close(fd)
    assert got["b"][1] == ("text", 7)
    np.testing.assert_array_equal(got["a"], value["a"])
    np.testing.assert_array_equal(got["b"][0], value["b"][0])
    assert got["c"][0].shape == (0,) and got["c"][1]["d"].tolist() == [b"xy", b"z"]
    assert not got["a"].flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        got["a"][0] = 1


@pytest.mark.parametrize("array", [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.array(3.5),
    np.zeros((0, 5), np.int64),
    np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
    np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
], ids=["3d", "scalar", "empty", "structured", "fortran"])
def test_np_load_of_a_npy_path_reads_the_file_into_shared_memory(tmp_path, array):
    """``load_once(np.load, path)`` reads a ``.npy`` file straight into the shared file (the machine never holds
    it twice); a Fortran-ordered array goes the generic way; either way the array is the file's."""
    path = tmp_path / "x.npy"
    np.save(path, array)
    assert once._npy_file(np.load, (str(path),), {}) == str(path)
    streamed = once._write_npy(path)
    assert (streamed is None) == (array.ndim > 1 and array.flags.f_contiguous and not array.flags.c_contiguous)
    fd = once._load(np.load, (path,), {"mmap_mode": "r"})
    try:
        got = once._read(fd)
    finally:
        os.close(fd)
        if streamed is not None:
            os.close(streamed)
    assert got.dtype == array.dtype and got.shape == array.shape and not got.flags.writeable
    np.testing.assert_array_equal(got, array)


def test_only_np_load_of_a_npy_path_is_streamed_and_a_short_file_says_so(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(1000, dtype=np.float32))
    np.savez(tmp_path / "x.npz", x=np.arange(3))
    assert once._npy_file(np.load, (tmp_path / "x.npz",), {}) is None  # an archive: np.load's own reading
    assert once._npy_file(np.load, (str(path),), {"encoding": "bytes"}) is None
    assert once._npy_file(np.loadtxt, (str(path),), {}) is None  # another function: called as it is
    assert once._npy_file(np.load, (str(tmp_path / "missing.npy"),), {}) is None  # np.load raises its own error
    (tmp_path / "short.npy").write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"short\.npy' ends after 3900 of the 4000 bytes"):
        once._write_npy(tmp_path / "short.npy")


def test_a_large_npy_file_is_held_once_while_it_loads(tmp_path):
    """The peak resident memory of a process that shares a 256 MB ``.npy`` file grows by about the file's size,
    not twice it (``np.load`` then a copy would)."""
    import subprocess

    path = tmp_path / "big.npy"
    np.save(path, np.ones(64 << 20, np.float32))
    code = ("import sys, numpy as np\n"
            "from multigpu.runtime import load_once as once\n"
            "def kb(name):\n"
            "    return next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith(name))\n"
            "open('/proc/self/clear_refs', 'w').write('5')  # the peak from here on, not the imports'\n"
            "before = kb('VmRSS:')\n"
            "fd = once._load(np.load, (sys.argv[1],), {})\n"
            "x = once._read(fd)\n"
            "assert float(x[::4096].sum()) == x.size / 4096\n"
            "print((kb('VmHWM:') - before) * 1024)\n")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    grown = int(res.stdout.split()[-1])
    assert grown < 1.2 * (256 << 20), f"peak grew by {grown >> 20} MB for a 256 MB file"


def test_bad_input_is_refused_with_what_was_received():
    with pytest.raises(TypeError, match=r"Received: 'x\.npy' of type str"):
        once.load_once("x.npy")
    with pytest.raises(TypeError, match="Python objects"):
        once._write({"x": np.array([{}, []], dtype=object)})


def test_plain_script_loads_once_and_the_supervisor_gives_its_memory_back(runner, tmp_path):
    """Under ``python train.py`` the script's first process loads, becomes a small supervisor (same pid) and
    the ranks map its file; training on the shared arrays equals one device."""
    counter, out = tmp_path / "counter", tmp_path / "out.json"
    shm_before = set(os.listdir("/dev/shm"))
    proc = runner.start([sys.executable, str(SCRIPTS / "load_once.py"), str(counter), str(out)])
    result = runner.finish(proc, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    seen = json.loads(out.read_text())
    assert counter.read_text().split() == [str(proc.pid)]  # loaded once, in the first process
    assert seen["supervisor"] == proc.pid  # the supervisor kept the script's pid
    assert seen["supervisor_rss_kb"] < 120_000, seen  # it no longer holds Keras, torch nor the script's data
    assert seen["error"] < 1e-6 and not seen["writeable"] and seen["other"] == ["a label", 3]
    assert set(os.listdir("/dev/shm")) - shm_before == set()
    assert runner.leftovers() == []


def test_outside_launcher_loads_once_per_machine(runner, tmp_path):
    """Under a launcher's variables (torchrun's), local rank 0 loads and hands the file to the other ranks."""
    counter, out = tmp_path / "counter", tmp_path / "out"
    port = _free_port()
    procs = [runner.start([sys.executable, str(SCRIPTS / "load_once.py"), str(counter), str(out), "--no-fit"],
                          {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(3)]
    results = [runner.finish(p, timeout=60) for p in procs]
    assert all(r.returncode == 0 for r in results), [r.stdout[-2000:] for r in results]
    assert counter.read_text().split() == [str(procs[0].pid)]
    seen = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(3)]
    assert len({s["sum"] for s in seen}) == 1 and not any(s["writeable"] for s in seen)
    assert all(s["other"] == ["a label", 3] for s in seen)
    assert runner.leftovers() == []


def test_memory_mapped_rows_become_floatx_a_batch_at_a_time(tmp_path):
    """A float64 memory-mapped array is not converted whole: each batch's rows are read and converted."""
    import keras

    from multigpu.data.arrays import ArraySource
    from multigpu.planning.plan import StepPlanner

    path = tmp_path / "x.npy"
    np.save(path, np.arange(40, dtype=np.float64).reshape(20, 2))
    x = np.load(path, mmap_mode="r")
    source = ArraySource(x, None, None, batch_size=8, shuffle=True, seed=3)
    assert source.parts[0] is x  # kept mapped
    source.set_epoch(0)
    planner = StepPlanner(lambda total: [total], 0)
    batches = list(source.batches(lambda rows, again: planner.plan(rows, for_step=False, again=again)))
    rows = np.concatenate([b[0] if isinstance(b, tuple) else b for b in batches])
    assert all((b[0] if isinstance(b, tuple) else b).dtype == keras.backend.floatx() for b in batches)
    assert not any(isinstance(b[0] if isinstance(b, tuple) else b, np.memmap) for b in batches)
    np.testing.assert_array_equal(np.sort(rows[:, 0]), np.arange(0, 40, 2, dtype=np.float32))


def test_device_memory_sizes_parse_and_bad_ones_say_what_is_allowed():
    from multigpu.devices import parse_devices

    devices = parse_devices(["cpu:0/1536MiB", "cpu:1@0.5/2GiB", "cpu:2"])
    assert [d.memory for d in devices] == [1536 << 20, 2 << 30, None]
    assert [d.spec for d in devices] == ["cpu:0/1.5GiB", "cpu:1@0.5/2GiB", "cpu:2"]
    assert parse_devices(",".join(d.spec for d in devices)) == devices
    with pytest.raises(ValueError, match="Received: 'lots'"):
        parse_devices(["cpu:0/lots"])
    with pytest.raises(ValueError, match="only given to CPU devices"):
        parse_devices(["cuda:0/2GiB"], num_gpus=1)


@pytest.mark.outside  # make test-outside: the convnet's test below runs the same policy in make test
def test_a_fast_device_with_little_memory_gets_what_fits_and_an_out_of_memory_step_is_taken_again(runner, tmp_path):
    """``cpu:0/64MiB`` (fast, small) beside ``cpu:1@0.5`` (slow, unbounded), automatic shares from a fresh profile,
    batch 512 then 1024: CPU:0's memory per row is measured and its cap keeps the plans within it (its speed share
    would give it more); an out-of-memory error injected in rank 0's 40th step (and any real one, where the
    measurement was short): no rank hangs or applies the step, CPU:0's cap is lowered, the same global batch is
    cut again and taken again within seconds; the weights equal one device's."""
    out = tmp_path / "out.json"
    devices = "cpu:0/64MiB,cpu:1@0.5"
    result = runner.ranks(devices, "memory_caps.py", devices, "auto", str(out), "--batch", "512",
                           timeout=240, extra_env={"MULTIGPU_FAULT": "0:forward/oom:40"})
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"multigpu: CPU:0 holds at most \d+ rows \(.* a row of .* left\): shares", result.stdout), \
        result.stdout[-3000:]
    found = re.findall(r"out of memory on CPU:0 at (\d+) rows: CPU:0 holds at most (\d+) rows; the step again with "
                       r"rows CPU:0 (\d+), CPU:1@0.5 (\d+) of (\d+) \(([\d.]+) s after the error\)", result.stdout)
    assert found, result.stdout[-3000:]
    for short, cap, rows, other, total, seconds in found:
        assert int(rows) <= int(cap) < int(short) and int(rows) + int(other) == int(total) and float(seconds) < 5.0
    assert json.loads(out.read_text())["error"] < 1e-5
    assert runner.leftovers() == []


@pytest.mark.parametrize("backend, size, batch, fault", [
    pytest.param("tensorflow", "256MiB", 1024, "0:forward/oom:20", marks=pytest.mark.outside),
    pytest.param("jax", "512MiB", 2048, "0:forward/oom:10", marks=pytest.mark.outside),
])
def test_tensorflow_and_jax_cap_a_device_by_its_measured_memory_and_take_an_out_of_memory_step_again(
        runner, tmp_path, backend, size, batch, fault):
    """The same on TensorFlow and JAX, through the same neutral policy and step driver: ``cpu:0/SIZE`` beside
    ``cpu:1@0.5``, batch B then 2B. TensorFlow's CPU allocator keeps the pool it grew, so the measurement
    reads the process's private memory (what the limit counts) and its pool is held to half the device's size
    (the rest stays for the step's sums). JAX's compiler and kernels allocate in the same process, a new
    executable per local batch size, so its device is given more (at 384MiB XLA's compiler aborted the process
    with ``std::bad_alloc``, which nothing can take again); its kernels' failed workspace (``YNNPACK operation
    failed``) is an out-of-memory step. An out-of-memory error injected in rank 0's Nth step, and any real one,
    is taken again within seconds; the weights equal one device's."""
    out = tmp_path / "out.json"
    devices = f"cpu:0/{size},cpu:1@0.5"
    result = runner.ranks(devices, "memory_caps.py", devices, "auto", str(out), "--batch", str(batch),
                           timeout=300, extra_env={"MULTIGPU_FAULT": fault, "KERAS_BACKEND": backend})
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"multigpu: CPU:0 holds at most \d+ rows \(.* a row of \d+MiB left\): shares", result.stdout), \
        result.stdout[-3000:]
    found = re.findall(r"out of memory on CPU:0 at (\d+) rows: CPU:0 holds at most (\d+) rows; the step again "
                       r"with rows CPU:0 (\d+), CPU:1@0.5 (\d+) of (\d+) \(([\d.]+) s after the error\)",
                       result.stdout)
    assert found, result.stdout[-3000:]
    for short, cap, rows, other, total, seconds in found:
        assert int(rows) <= int(cap) < int(short) and int(rows) + int(other) == int(total) and float(seconds) < 5.0
    assert json.loads(out.read_text())["error"] < 1e-5
    assert runner.leftovers() == []


@pytest.mark.parametrize("backend, size", [("torch", "160MiB"), ("tensorflow", "384MiB"),
                                           pytest.param("jax", "640MiB", marks=pytest.mark.outside)])
def test_a_convnet_on_a_device_with_little_memory_at_batch_b_then_2b_equals_one_device(runner, tmp_path, backend,
                                                                                       size):
    """A convnet (two convolutions, 28x28 images) on ``cpu:0/SIZE`` beside ``cpu:1@0.5``, automatic shares from a
    fresh profile, batch 256 then 512: SIZE holds about 40% of the larger batch (torch 38%, TensorFlow 48%,
    JAX 38% measured), less than CPU:0's speed share; an out-of-memory error injected in rank 0's 10th step
    (the second fit's) is taken again; the weights equal one device's."""
    out = tmp_path / "out.json"
    devices = f"cpu:0/{size},cpu:1@0.5"
    result = runner.ranks(devices, "memory_caps.py", devices, "auto", str(out), "--batch", "256",
                           "--model", "convnet", timeout=300,
                           extra_env={"MULTIGPU_FAULT": "0:forward/oom:10", "KERAS_BACKEND": backend})
    assert result.returncode == 0, result.stdout[-3000:]
    caps = [int(c) for c in re.findall(r"multigpu: CPU:0 holds at most (\d+) rows \(", result.stdout)]
    assert caps and caps[0] < 512 * 0.6, result.stdout[-3000:]
    assert re.search(r"out of memory on CPU:0 at \d+ rows: CPU:0 holds at most \d+ rows; the step again with rows "
                     r"CPU:0 \d+, CPU:1@0.5 \d+ of 512", result.stdout), result.stdout[-3000:]
    assert json.loads(out.read_text())["error"] < 1e-5
    assert runner.leftovers() == []


@pytest.mark.parametrize("backend", ["torch", "tensorflow", pytest.param("jax", marks=pytest.mark.outside)])
def test_a_train_step_of_the_models_own_that_runs_out_of_memory_is_taken_again(runner, tmp_path, backend):
    """A ``train_step`` of the model's own (each backend's guide) on ``cpu:0/1GiB`` beside ``cpu:1``, an
    out-of-memory error injected in rank 0's 5th step before its optimizer call: the step's first gradient sum
    carries every rank's memory word, so no rank applies it; CPU:0's cap is lowered, the same global batch cut
    again and the step taken again within seconds; the weights equal one device's."""
    out = tmp_path / "out.json"
    devices = "cpu:0/1GiB,cpu:1"
    result = runner.ranks(devices, "custom_oom.py", devices, str(out), timeout=240,
                           extra_env={"MULTIGPU_FAULT": "0:forward/oom:5", "KERAS_BACKEND": backend})
    assert result.returncode == 0, result.stdout[-3000:]
    found = re.findall(r"out of memory on CPU:0 at (\d+) rows: CPU:0 holds at most (\d+) rows; the step again "
                       r"with rows CPU:0 (\d+), CPU:1 (\d+) of (\d+) \(([\d.]+) s after the error\)", result.stdout)
    assert len(found) == 1, result.stdout[-3000:]
    short, cap, rows, other, total, seconds = found[0]
    assert int(rows) <= int(cap) < int(short) and int(rows) + int(other) == int(total) and float(seconds) < 5.0
    assert json.loads(out.read_text())["error"] < 1e-5
    assert runner.leftovers() == []


def test_fixed_ratios_a_device_cannot_hold_end_the_run_naming_the_share_that_fits(runner, tmp_path):
    devices = "cpu:0/48MiB,cpu:1"
    result = runner.ranks(devices, "memory_caps.py", devices, "9:1", str(tmp_path / "out.json"),
                           "--batch", "1024", timeout=240)
    assert result.returncode != 0
    assert re.search(r"CPU:0 \(48MiB given\) ran out of memory with \d+ rows of a global batch of 1024, its part "
                     r"of the fixed ratios 9:1; it holds about \d+ rows", result.stdout), result.stdout[-3000:]
    assert "ratios='auto'" in result.stdout
    assert runner.leftovers() == []


def test_a_global_batch_no_device_set_can_hold_ends_the_run_naming_the_caps(runner, tmp_path):
    devices = "cpu:0/24MiB,cpu:1/24MiB"
    result = runner.ranks(devices, "memory_caps.py", devices, "auto", str(tmp_path / "out.json"),
                           "--batch", "2048", timeout=240)
    assert result.returncode != 0
    assert "cannot hold a global batch of 2048 rows together (CPU:0 at most" in result.stdout, result.stdout[-3000:]
    assert "the largest global batch that fits is" in result.stdout
    assert runner.leftovers() == []


def test_a_cap_counts_what_a_larger_batch_keeps_and_what_is_not_measured_yet():
    """A device keeps more after a step at a larger local batch than any before (kernels' caches, compiled
    executables): until two sizes are measured that is taken as much as a row's step; then it is the slope of
    the memory left against the largest batch run, which a smaller batch after it does not change."""
    from multigpu.balancing.memory import MARGIN, RowMemory

    kib, mib = 1024, 1 << 20
    rows = RowMemory()
    rows.add(200, 200 * 100 * kib, left=40 * mib)
    assert rows.kept_per_row() is None
    assert rows.cap(40 * mib, 200) == int((40 * mib * (1 - MARGIN) + 100 * kib * 200) / (200 * kib))
    rows.add(300, 300 * 100 * kib, left=37 * mib)  # 3 MiB less left after 100 more rows: 30.72 KB a row kept
    assert abs(rows.kept_per_row() - 3 * mib / 100) < 1e-6
    rows.add(100, 100 * 100 * kib, left=37 * mib)  # a smaller batch after: the largest run is still 300
    assert abs(rows.kept_per_row() - 3 * mib / 100) < 1e-6
    kept = 3 * mib / 100
    assert rows.cap(37 * mib, 100) == int((37 * mib * (1 - MARGIN) + kept * 300) / (100 * kib + kept))
    flat = RowMemory()  # nothing kept: the cap is the memory left over a row's step
    flat.add(200, 200 * 100 * kib, left=40 * mib)
    flat.add(300, 300 * 100 * kib, left=40 * mib)
    assert flat.kept_per_row() == 0.0 and flat.cap(40 * mib, 300) == int(40 * mib * (1 - MARGIN) / (100 * kib))


def test_a_model_whose_training_state_a_device_cannot_hold_trains_with_the_weights_in_parts(runner, tmp_path):
    """``cpu:0/40MiB`` beside ``cpu:1/120MiB``, a model of 32 MiB of weights in eight 4 MiB layers, Adam: less than
    its weights and gradients (64 MiB) on ``cpu:0``.  The whole state (96 MiB more) and the optimizer state in
    parts (the gradients and the moments of cpu:0's quarter: 48 MiB) end before their first step with the same
    error on every rank, naming the level that fits; with the weights in parts (``shard="weights"``) it trains both
    epochs, ``cpu:0`` holding its quarter of the weights and never more than two 4 MiB layers of the others' at
    once (one gathered, and a room kept for the next gather), and its losses are one unbounded device's (within
    1e-4; its weights equal the whole state's in ``tests/test_sharding.py``)."""
    devices = "cpu:0/40MiB,cpu:1/120MiB"
    run = [sys.executable, "-m", "multigpu", "run", "--devices", devices, str(SCRIPTS / "state_fits.py"), devices]
    outs = {level: str(tmp_path / f"{level}.json") for level in ("whole", "optimizer", "weights", "one")}
    whole, optimizer, weights, one = runner.together(
        *(([*run, level, outs[level]], None) for level in ("whole", "optimizer", "weights")),
        ([sys.executable, str(SCRIPTS / "state_fits.py"), "cpu:0", "one", outs["one"]], None), timeout=400)
    for result, spelled, adds in ((whole, "shard_optimizer=False", 96), (optimizer, "shard='optimizer'", 48)):
        assert result.returncode != 0, result.stdout[-3000:]
        found = re.search(rf"ValueError: the training state does not fit at {re.escape(spelled)}: "
                          r"CPU:0 \(40MiB given\) has ([\d.]+) MiB left after the weights, and the first step "
                          r"adds ([\d.]+) MiB .*"
                          r"shard='gradients' fits: the first step adds ([\d.]+) MiB on CPU:0", result.stdout)
        assert found, result.stdout[-3000:]
        left, needed, fits = map(float, found.groups())
        assert abs(needed - adds) < 1 and abs(fits - 16) < 1 and fits < left < needed and left <= 40
        assert "calibrated" not in result.stdout and "failed: RuntimeError" not in result.stdout  # no step began
    assert weights.returncode == 0 and one.returncode == 0, (weights.stdout + one.stdout)[-3000:]
    held = re.search(r"the weights in parts: CPU:0 owned ([\d.]+) MiB of ([\d.]+) MiB and held at most ([\d.]+) MiB "
                     r"of the others' at once", weights.stdout)
    assert held, weights.stdout[-3000:]
    owned, total, most = map(float, held.groups())
    assert abs(owned - total / 4) < 1 and 4 <= most <= 8.1 and owned + most < total / 2 + 0.1, held.group(0)
    losses = json.loads(open(outs["weights"]).read())["loss"]
    reference = json.loads(open(outs["one"]).read())["loss"]
    assert len(losses) == 2 and losses[1] < losses[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
    assert runner.leftovers() == []
