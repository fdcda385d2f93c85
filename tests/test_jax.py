"""The JAX backend (``KERAS_BACKEND=jax``) on real processes, against one plain JAX process.

The same scripts as the torch tests: ``exactness.py`` (Dense, Conv2D, GRU,
Embedding, L2; SGD and Adam at 3:1, Adam at 1:2:5; 193 rows at global batch
64, so the last step has one row and some ranks none) and ``keras_features.py`` (two inputs and
outputs, sample and class weights, BatchNorm, Dropout, validation, callbacks,
checkpoints, evaluate, predict).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SCRIPTS, run_beside
from tests.test_exactness import ROWS, TOLERANCE, load, max_relative_error
from tests.test_keras import load as load_features
from tests.test_keras import rel
from tests.test_launch import _free_port, torchrun_matches_one_machine
from tests.test_reliability import kill_rank_1_mid_epoch

pytest.importorskip("jax", reason="the JAX backend's tests need jax (make test installs it)")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

# XLA's optimizations off in every JAX process of these tests (plain and parallel alike): they test behaviour
# and exactness, and compiling takes most of their time (a third less this way).
FAST_COMPILE = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
JAX = {"KERAS_BACKEND": "jax", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1",
       **FAST_COMPILE}
ON_JAX = {"KERAS_BACKEND": "jax", **FAST_COMPILE}
COMPRESSED_TOLERANCE = 1e-2  # bf16 keeps 8 bits of mantissa: about 0.4% per summed gradient


def _plain(script: str, *args: str, cwd) -> None:
    res = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, check=False,
                         text=True, timeout=150, env={**os.environ, **JAX}, cwd=cwd)
    assert res.returncode == 0, res.stdout + res.stderr


def _out(folder, ratios: str, optimizers: str, *extra: str) -> Path:
    return folder / f"par-{ratios}-{optimizers}{'-bf16' if extra else ''}.npz"


def _command(folder, ratios: str, optimizers: str, *extra: str) -> tuple[list[str], dict]:
    """``multigpu run`` of ``exactness.py`` on JAX, writing :func:`_out` in ``folder``."""
    n = len(ratios.split(","))
    return ([sys.executable, "-m", "multigpu", "run", "--devices", ",".join(f"cpu:{i}" for i in range(n)),
             "--ratios", ratios, str(SCRIPTS / "exactness.py"), str(_out(folder, ratios, optimizers, *extra)),
             "--rows", ROWS, "--optimizers", optimizers, *extra], ON_JAX)


BESIDE = {"3,1-sgd,adam": ("3,1", "sgd,adam"), "bf16": ("3,1", "sgd", "--compression", "bf16")}  # make test's


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The plain JAX reference beside make test's parallel runs (``BESIDE``), all at once (``run_beside``): their
    folder and results."""
    folder = tmp_path_factory.mktemp("jax")
    plain = ([sys.executable, str(SCRIPTS / "exactness.py"), str(folder / "plain.npz"), "--plain", "--rows", ROWS],
             JAX)
    return folder, run_beside(folder, {"plain": plain, **{k: _command(folder, *v) for k, v in BESIDE.items()}}, 200)


@pytest.fixture(scope="module")
def reference(runs):
    folder, done = runs
    assert done["plain"].returncode == 0, done["plain"].stdout[-3000:]
    return load(folder / "plain.npz")


def _parallel(runner, runs, name: str, *case: str):
    """The run of that case (from ``runs`` where it ran beside the reference): its result and its output file."""
    folder, done = runs
    if name not in done:
        args, extra = _command(runner.tmp_path, *case)
        folder, done = runner.tmp_path, {name: runner.run(args, extra_env=extra)}
    return done[name], _out(folder, *case)


@pytest.mark.parametrize(("ratios", "optimizers"), [("3,1", "sgd,adam"), ("1,2,5", "adam")])
def test_parallel_run_matches_single_device_on_jax(runner, runs, reference, ratios, optimizers):
    n = len(ratios.split(","))
    res, out = _parallel(runner, runs, f"{ratios}-{optimizers}", ratios, optimizers)
    assert res.returncode == 0, res.stdout
    got = load(out, optimizers.split(","))
    for name in optimizers.split(","):
        tolerance = TOLERANCE[name]
        ref_weights, ref_history = reference[name]
        weights, history = got[name]
        assert max_relative_error(ref_weights, weights) <= tolerance, name
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(history[key], ref_history[key], rtol=tolerance)
    for r in range(1, n):  # every rank ends with the same weights and the same global history
        other = load(f"{out}.rank{r}.npz", optimizers.split(","))
        for name in optimizers.split(","):
            assert max_relative_error(got[name][0], other[name][0]) == 0.0
            assert other[name][1] == got[name][1]
    assert runner.leftovers() == []


def test_compression_on_jax_sends_16_bits_and_stays_close(runner, runs, reference):
    """bf16 gradients (3:1, SGD): near the exact run, every rank alike, and not exact (really 16 bits)."""
    res, out = _parallel(runner, runs, "bf16", *BESIDE["bf16"])
    assert res.returncode == 0, res.stdout
    weights, history = load(out, ["sgd"])["sgd"]
    error = max_relative_error(reference["sgd"][0], weights)
    assert 1e-6 < error <= COMPRESSED_TOLERANCE, error
    np.testing.assert_allclose(history["loss"], reference["sgd"][1]["loss"], rtol=COMPRESSED_TOLERANCE)
    assert max_relative_error(weights, load(f"{out}.rank1.npz", ["sgd"])["sgd"][0]) == 0.0
    assert runner.leftovers() == []


def test_keras_features_on_jax(runner):
    folder = runner.tmp_path
    _plain("keras_features.py", "two_output,sync_bn,shared_bn", str(folder / "plain"), "--plain", cwd=folder)
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", str(SCRIPTS / "keras_features.py"),
                     "two_input,two_output,sync_bn,shared_bn", str(folder / "par"), "--steps-per-execution", "3",
                     extra_env=ON_JAX, timeout=180)
    assert res.returncode == 0, res.stdout
    plain = load_features(folder / "plain-two_output.npz")
    r0, r1 = load_features(folder / "par-two_output.npz"), load_features(folder / "par-two_output.npz.rank1.npz")
    assert rel(plain["weights"], r0["weights"]) < 1e-5
    for key in plain["history"]:  # three batches a call (steps_per_execution=3) against one
        np.testing.assert_allclose(r0["history"][key], plain["history"][key], rtol=1e-5)
    for key, value in plain["evaluate"].items():
        assert r0["evaluate"][key] == pytest.approx(value, rel=1e-5)
        assert r1["evaluate"][key] == r0["evaluate"][key]
    for key in ("pred_reg", "pred_cls"):
        np.testing.assert_allclose(r0[key], plain[key], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(r0[key], r1[key])
    # Callbacks saw the same global logs on both ranks; Dropout draws differ; BatchNorm statistics agree.
    t0, t1 = load_features(folder / "par-two_input.npz"), load_features(folder / "par-two_input.npz.rank1.npz")
    assert t0["history"] == t1["history"] and "val_loss" in t0["history"]
    assert float(t0["lr"]) == float(t1["lr"]) < 0.01
    assert not np.array_equal(t0["mask"], t1["mask"])
    np.testing.assert_array_equal(t0["weights_moving"], t1["weights_moving"])
    assert bool(t0["api_loaded"]) and bool(t1["api_loaded"])
    assert ".keras" in t0["save_error"][0] and t0["save_error"] == t1["save_error"]
    assert res.stdout.count("multigpu: 2 device(s): CPU:0 75%, CPU:1 25%") == 1
    # sync_batchnorm=True: statistics of the whole global batch (3:1; the last batch of each epoch has one row,
    # so rank 1 has none and only exchanges zeros), as one device computes them; with one layer applied in two
    # parallel branches too (the exchanges pair in program order, the same on every rank).
    for mode in ("sync_bn", "shared_bn"):
        plain, r0, r1 = (load_features(folder / f) for f in (f"plain-{mode}.npz", f"par-{mode}.npz",
                                                              f"par-{mode}.npz.rank1.npz"))
        assert rel(plain["weights"], r0["weights"]) < 1e-5, mode
        np.testing.assert_allclose(r0["history"]["loss"], plain["history"]["loss"], rtol=1e-5)
        np.testing.assert_array_equal(r0["weights"], r1["weights"])
    # The best checkpoint is a plain Keras file that a process without multigpu loads.
    code = ("import sys, keras\n"
            f"keras.saving.load_model({str(folder / 'best.keras')!r})\n"
            "assert 'multigpu' not in sys.modules\nprint('loaded ok')\n")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False, text=True, timeout=60,
                            env={**os.environ, **JAX})
    assert "loaded ok" in loaded.stdout, loaded.stdout + loaded.stderr
    assert runner.leftovers() == []


@pytest.mark.parametrize("batchnorm", [[], ["--sync-bn"], ["--rows", "9", "--batch", "1"]],
                         ids=["plain", "sync_batchnorm", "one_row_batches"])
def test_a_custom_jax_train_step_matches_one_device(runner, batchnorm):
    """keras.io's JAX train_step and test_step (stateless_apply, metrics' stateless updates, an extra scalar
    log), 3:1, with a last step where rank 1 has no rows: weights, logs and evaluate as on one device; with
    ``--sync-bn``, a BatchNormalization layer with global statistics (its moving statistics are weights too);
    with batches of one row, rank 1 has no rows in any step, the first included (it runs the steps on a
    stand-in row of zeros with weight 0)."""
    folder = runner.tmp_path
    script = str(SCRIPTS / "custom_jax.py")
    one, res = runner.together(  # one device and two at once
        ([sys.executable, script, str(folder / "plain.npz"), "--plain", *batchnorm], ON_JAX),
        ([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1", "--ratios", "3,1", script,
          str(folder / "par.npz"), *batchnorm], ON_JAX), timeout=150)
    assert one.returncode == 0, one.stdout
    assert res.returncode == 0, res.stdout
    plain, par = np.load(folder / "plain.npz"), np.load(folder / "par.npz")
    other = np.load(folder / "par.npz.rank1.npz")
    for name, tolerance in TOLERANCE.items():
        keys = sorted(k for k in plain.files if k.startswith(f"{name}.w"))
        assert max_relative_error([plain[k] for k in keys], [par[k] for k in keys]) <= tolerance, name
        assert max_relative_error([par[k] for k in keys], [other[k] for k in keys]) == 0.0
        want, got = (json.loads(str(d[f"{name}.history"])) for d in (plain, par))
        for key in ("loss", "mae"):
            np.testing.assert_allclose(got[key], want[key], rtol=tolerance)
        assert got["scale"] == [2.0, 2.0]
        want, got, got1 = (json.loads(str(d[f"{name}.evaluate"])) for d in (plain, par, other))
        assert got == got1 and set(got) == {"loss", "mae", "rows"}
        for key in ("loss", "mae"):
            assert got[key] == pytest.approx(want[key], rel=tolerance)
        # an extra scalar is the rows-weighted mean over ranks of the last batch (1 row: rank 1 has none)
        assert got["rows"] == want["rows"] == 1.0
    assert runner.leftovers() == []


def test_a_killed_rank_ends_the_jax_run_naming_it(runner):
    kill_rank_1_mid_epoch(runner, ON_JAX)


def test_torchrun_two_machines_on_loopback_on_jax(runner):
    """Several machines: torchrun starts each rank through multigpu's entry, which joins before the script runs."""
    torchrun_matches_one_machine(runner, {**ON_JAX, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}"},
                                 through_entry=True)
