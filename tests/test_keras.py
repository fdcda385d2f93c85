"""Keras completeness: each feature on 2 real processes against one plain process (one run of each)."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import SCRIPTS, run_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

COMPARED = "two_output,sync_bn,shared_bn"


def load(path):
    data = np.load(path)
    out = {}
    for k in data.files:
        v = data[k]
        out[k] = json.loads(str(v)) if v.dtype.kind == "U" else v
    return out


def rel(a, b):
    return float(np.abs(a - b).max() / (np.abs(a).max() + 1e-12))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One plain process and one 2-device run (3:1) of every feature."""
    folder = tmp_path_factory.mktemp("features")
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default",
           "PYTHONUNBUFFERED": "1"}
    plain, par = run_together(
        {"args": [sys.executable, str(SCRIPTS / "keras_features.py"), COMPARED, str(folder / "plain"), "--plain"],
         "env": env, "cwd": folder},
        {"args": [sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1",
                  str(SCRIPTS / "keras_features.py"), "all", str(folder / "par")], "env": env, "cwd": folder},
        timeout=200)
    assert plain.returncode == 0, plain.stdout
    assert par.returncode == 0, par.stdout
    return folder, par.stdout


def pair(folder, mode):
    return (load(folder / f"plain-{mode}.npz"), load(folder / f"par-{mode}.npz"),
            load(folder / f"par-{mode}.npz.rank1.npz"))


def test_two_outputs_sample_weight_evaluate_and_predict_match_one_device(runs):
    plain, r0, r1 = pair(runs[0], "two_output")
    assert rel(plain["weights"], r0["weights"]) < 1e-5
    for key in plain["history"]:
        np.testing.assert_allclose(r0["history"][key], plain["history"][key], rtol=1e-5)
    for key, value in plain["evaluate"].items():
        assert r0["evaluate"][key] == pytest.approx(value, rel=1e-5)
        assert r1["evaluate"][key] == r0["evaluate"][key]
    for key in ("pred_reg", "pred_cls"):
        np.testing.assert_allclose(r0[key], plain[key], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(r0[key], r1[key])


@pytest.mark.parametrize("mode", ["sync_bn", "shared_bn"])
def test_sync_batchnorm_reproduces_one_device(runs, mode):
    """Two BatchNorm layers; one layer applied in two parallel branches (its collectives pair by order)."""
    plain, r0, r1 = pair(runs[0], mode)
    assert rel(plain["weights"], r0["weights"]) < 1e-5
    np.testing.assert_allclose(r0["history"]["loss"], plain["history"]["loss"], rtol=1e-5)
    np.testing.assert_array_equal(r0["weights"], r1["weights"])


def test_callbacks_checkpoint_and_saved_model(runs):
    folder, out = runs
    r0, r1 = load(folder / "par-two_input.npz"), load(folder / "par-two_input.npz.rank1.npz")
    # Every rank saw the same global logs, so EarlyStopping stopped both at
    # once and ReduceLROnPlateau / LearningRateScheduler set the same rates.
    assert r0["history"] == r1["history"]
    assert float(r0["lr"]) == float(r1["lr"]) < 0.01
    assert "val_loss" in r0["history"] and "val_accuracy" in r0["history"]
    # Dropout draws differently on each rank; BatchNorm statistics agree.
    assert not np.array_equal(r0["mask"], r1["mask"])
    np.testing.assert_array_equal(r0["weights_moving"], r1["weights_moving"])
    # The summary is the user's model plus one line with the current shares; printed once.
    assert out.count("multigpu: 2 device(s): CPU:0 75%, CPU:1 25%") == 1
    assert "batch_normalization" in out and "dropout" in out
    # CSVLogger wrote from rank 0 only: one header, one row per epoch.
    with open(folder / "log.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0][0] == "epoch" and len(rows) == len(r0["history"]["loss"]) + 1
    # ... and it was complete, for every rank, when fit returned.
    assert int(r0["csv_rows"]) == int(r1["csv_rows"]) == len(rows)
    # A save Keras refuses raises its error on every rank, not on rank 0 alone.
    assert ".keras" in r0["save_error"][0] and r0["save_error"] == r1["save_error"]
    # keras.saving.save_model, called on every rank, wrote one file that every rank loaded with its own weights.
    assert bool(r0["api_loaded"]) and bool(r1["api_loaded"])
    # The best checkpoint is a plain Keras file: a process without multigpu
    # loads it and predicts what rank 0 predicted.
    code = (
        "import sys, numpy as np, keras\n"
        f"d = np.load({str(folder / 'par-two_input.npz')!r})\n"
        f"m = keras.saving.load_model({str(folder / 'best.keras')!r})\n"
        "p = m.predict({'a': d['probe_a'], 'b': d['probe_b']}, verbose=0)\n"
        "assert 'multigpu' not in sys.modules\n"
        "np.testing.assert_allclose(p, d['pred'], rtol=1e-5, atol=1e-6)\n"
        "print('loaded ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False, text=True, timeout=60,
                         env={**os.environ, "KERAS_BACKEND": "torch"})
    assert "loaded ok" in res.stdout, res.stdout + res.stderr
    assert not list(folder.glob(".*.tmp*")), "a temporary file was left behind"
