"""Keras completeness: each feature on 2 real processes against one plain process."""

import csv
import json
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def load(path):
    data = np.load(path)
    out = {}
    for k in data.files:
        v = data[k]
        out[k] = json.loads(str(v)) if v.dtype.kind == "U" else v
    return out


def run_pair(runner, mode, ratios="3,1", extra_env=None):
    plain = runner.script("keras_features.py", mode, str(runner.tmp_path / "plain.npz"), "--plain")
    assert plain.returncode == 0, plain.stdout
    par = runner.script("keras_features.py", mode, str(runner.tmp_path / "par.npz"), "--ratios", ratios,
                        extra_env=extra_env)
    assert par.returncode == 0, par.stdout
    return (load(runner.tmp_path / "plain.npz"), load(runner.tmp_path / "par.npz"),
            load(runner.tmp_path / "par.npz.rank1.npz"), par.stdout)


def rel(a, b):
    return float(np.abs(a - b).max() / (np.abs(a).max() + 1e-12))


def test_two_outputs_sample_weight_evaluate_and_predict_match_one_device(runner):
    plain, r0, r1, _ = run_pair(runner, "two_output")
    assert rel(plain["weights"], r0["weights"]) < 1e-5
    for key in plain["history"]:
        np.testing.assert_allclose(r0["history"][key], plain["history"][key], rtol=1e-5)
    for key, value in plain["evaluate"].items():
        assert r0["evaluate"][key] == pytest.approx(value, rel=1e-5)
        assert r1["evaluate"][key] == r0["evaluate"][key]
    for key in ("pred_reg", "pred_cls"):
        np.testing.assert_allclose(r0[key], plain[key], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(r0[key], r1[key])
    assert runner.leftovers() == []


def test_sync_batchnorm_reproduces_one_device(runner):
    plain, r0, r1, _ = run_pair(runner, "sync_bn")
    assert rel(plain["weights"], r0["weights"]) < 1e-5
    np.testing.assert_allclose(r0["history"]["loss"], plain["history"]["loss"], rtol=1e-5)
    np.testing.assert_array_equal(r0["weights"], r1["weights"])


def test_pydataset_generator_and_dataloader_are_cut_exactly(runner):
    plain, r0, r1, out = run_pair(runner, "inputs", extra_env={"PYTHONWARNINGS": "default"})
    for kind in ("pydataset", "generator", "dataloader"):
        assert rel(plain[kind], r0[kind]) < 1e-5, kind
        np.testing.assert_array_equal(r0[kind], r1[kind])
    assert "every rank iterates its own copy" in out


def test_callbacks_checkpoint_and_saved_model(runner):
    par = runner.script("keras_features.py", "two_input", str(runner.tmp_path / "par.npz"))
    assert par.returncode == 0, par.stdout
    r0, r1 = load(runner.tmp_path / "par.npz"), load(runner.tmp_path / "par.npz.rank1.npz")
    # Every rank saw the same global logs, so EarlyStopping stopped both at
    # once and ReduceLROnPlateau / LearningRateScheduler set the same rates.
    assert r0["history"] == r1["history"]
    assert float(r0["lr"]) == float(r1["lr"]) < 0.01
    assert "val_loss" in r0["history"] and "val_accuracy" in r0["history"]
    # Dropout draws differently on each rank; BatchNorm statistics agree.
    assert not np.array_equal(r0["mask"], r1["mask"])
    np.testing.assert_array_equal(r0["weights_moving"], r1["weights_moving"])
    # The summary is the user's model plus one line; printed once.
    assert par.stdout.count("multigpu: 2 device(s): CPU:0 75%, CPU:1 25%") == 1
    assert "batch_normalization" in par.stdout and "dropout" in par.stdout
    # CSVLogger wrote from rank 0 only: one header, one row per epoch.
    with open(runner.tmp_path / "log.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0][0] == "epoch" and len(rows) == len(r0["history"]["loss"]) + 1
    # The best checkpoint is a plain Keras file: a process without multigpu
    # loads it and predicts what rank 0 predicted (EarlyStopping restored the
    # best weights, which ModelCheckpoint saved).
    code = (
        "import sys, numpy as np, keras\n"
        f"d = np.load({str(runner.tmp_path / 'par.npz')!r})\n"
        f"m = keras.saving.load_model({str(runner.tmp_path / 'best.keras')!r})\n"
        "p = m.predict({'a': d['probe_a'], 'b': d['probe_b']}, verbose=0)\n"
        "assert 'multigpu' not in sys.modules\n"
        "np.testing.assert_allclose(p, d['pred'], rtol=1e-5, atol=1e-6)\n"
        "print('loaded ok')\n"
    )
    res = runner.run([sys.executable, "-c", code])
    assert "loaded ok" in res.stdout, res.stdout
    assert not list(runner.tmp_path.glob(".*.tmp*")), "a temporary file was left behind"
    assert runner.leftovers() == []
