"""The public API: no import side effects, clear errors for bad input."""

import json
import re
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_import_sets_nothing(runner):
    code = (
        "import os, sys; before = dict(os.environ); import multigpu; "
        "assert dict(os.environ) == before, 'environment changed'; "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('keras', 'torch')], 'imported a framework'; "
        "assert multigpu.rank() == 0 and multigpu.world_size() == 1; "
        "print(sorted(multigpu.__all__))"
    )
    res = runner.run([sys.executable, "-c", code], extra_env={"KERAS_BACKEND": ""})
    assert res.returncode == 0, res.stdout
    assert ("['RankError', 'launch', 'list_devices', 'load_once', 'multi_gpu_model', 'parallelize', 'rank', 'state', "
            "'unparallelize', 'world_size']" in res.stdout)


EXPECTED = {
    "ratios_length": r"ValueError: .*one entry per device \(2 devices\), got 3.*ratios=\[1, 2, 3\]",
    "ratios_zero": r"ValueError: Every ratio must be a finite number greater than 0. Received: ratios=\[0, 1\]",
    "ratios_negative": r"ValueError: Every ratio .* Received: ratios=\[-1, 1\]",
    "ratios_nan": r"ValueError: Every ratio .* Received: ratios=\[nan, 1\]",
    "ratios_inf": r"ValueError: Every ratio .* Received: ratios=\[inf, 1\]",
    "ratios_string": r"ValueError: `ratios` must be a list of positive numbers \(e.g. \[3, 1\] or '3,1'\), 'auto', "
    r"the path of a profile .json file, or None. Received: ratios='fast'",
    "devices_repeat": r"ValueError: Device cpu:0 is listed twice",
    "devices_unknown": r"ValueError: Unknown device 'tpu:0'. Allowed:",
    "gpu_without_gpu": r"ValueError: Device 0 does not exist. This machine has no GPU: use CPU devices",
    "not_a_model": r"TypeError: .*takes a Keras 3 model.*Received: object",
    "timeout": r"ValueError: `timeout` must be a positive number of seconds. Received: timeout=-1",
    "gpus_zero": r"ValueError: `gpus` must be at least 1. Received: gpus=0",
    "twice": r"ValueError: multigpu.parallelize\(\) was already called on this model",
}


def test_bad_input_gives_clear_errors_before_any_process_starts(runner):
    res = runner.script("bad_input.py", timeout=90)
    assert res.returncode == 0, res.stdout
    lines = dict(line.split(": ", 1) for line in res.stdout.splitlines() if ": " in line)
    for case, pattern in EXPECTED.items():
        assert case in lines, res.stdout
        assert re.search(pattern, lines[case]), f"{case}: {lines[case]}"
    assert runner.leftovers() == []


def test_a_backend_multigpu_does_not_run_on_is_refused(monkeypatch):
    import keras

    from multigpu import api

    monkeypatch.setattr(keras.backend, "backend", lambda: "openvino")
    with pytest.raises(RuntimeError, match=r"torch, jax or tensorflow backend.*Received: backend='openvino'"):
        api.parallelize(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), ["cpu:0"])


@pytest.mark.multiprocess
def test_inputs_and_targets_of_different_lengths_fail_on_every_rank(runner):
    code = (
        "import keras, numpy as np, multigpu\n"
        "m = multigpu.parallelize(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),"
        " ['cpu:0', 'cpu:1'], timeout=20)\n"
        "m.compile(optimizer='sgd', loss='mse')\n"
        "try:\n"
        "    m.fit(np.zeros((10, 2)), np.zeros((9, 1)), batch_size=4, verbose=0)\n"
        "except ValueError as e:\n"
        "    print(f'rank {multigpu.rank()}: {e}', flush=True); raise SystemExit(2)\n"
    )
    script = runner.tmp_path / "lengths.py"
    script.write_text(code)
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", str(script), timeout=90)
    assert res.returncode != 0
    for r in (0, 1):
        assert f"rank {r}: All inputs, targets and sample weights must have the same number of rows" in res.stdout
    assert "x: [10], y: [9]" in res.stdout
    assert runner.leftovers() == []


def test_cli_devices_json_and_bad_arguments(runner):
    import json

    res = runner.cli("devices", "--json")
    assert res.returncode == 0, res.stdout
    info = json.loads(res.stdout)
    assert info["cpu_cores"] >= 1 and info["versions"]["torch"]
    assert any(d["device"] == "cpu:0" for d in info["devices"])
    bad = runner.cli("run", "--devices", "cpu:0,cpu:0", "x.py")
    assert bad.returncode == 2
    bad = runner.cli("run", "--devices", "cpu:0,cpu:1", "--ratios", "1,-1", "/dev/null")
    assert bad.returncode == 2 and "Every ratio" in bad.stdout
    bad = runner.cli("run", "--devices", "cpu:0", "--frobnicate", "x.py")
    assert bad.returncode == 2


def test_launch_refuses_what_it_cannot_run_saying_what_it_takes():
    import multigpu

    with pytest.raises(TypeError, match=r"takes a function to run on every device\. Received: 3"):
        multigpu.launch(3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['epochs'\].*Received: epochs=2"):
        multigpu.launch(print, epochs=2)
    import threading

    with pytest.raises(TypeError, match="must be picklable"):
        multigpu.launch(print, threading.Lock())  # a lock cannot travel to the ranks


def test_the_keras_range_pyproject_claims_is_the_one_multigpu_checks_at_import():
    """One claim: ``_compat.TESTED`` (what ``make compat`` ran) is what pyproject.toml asks pip for."""
    from pathlib import Path

    from multigpu._keras import compat as _compat

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert f'"{_compat._requirement()}"' in text, _compat._requirement()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_unparallelize_gives_back_a_plain_keras_model_and_no_class_is_changed(runner):
    """After a fit on two devices with global BatchNorm and a BackupAndRestore, ``unparallelize`` puts back every
    attribute (checked by identity), ``keras.saving`` is Keras's own, no Keras class changed at any point, and the
    model trains on each process alone (the same start, the same rows: the same weights on both ranks)."""
    out = runner.tmp_path / "plain"
    res = runner.ranks("cpu:0,cpu:1", "unparallelize.py", str(out), timeout=150)
    assert res.returncode == 0, res.stdout
    found = [json.loads((runner.tmp_path / f"plain.rank{r}.json").read_text()) for r in range(2)]
    for f in found:
        assert f["same_object"] and f["fit_is_keras"] and f["saving_is_keras"] and f["state_refused"]
        assert "fit" in f["set_on_model_while_parallel"] and "train_step" in f["set_on_model_while_parallel"]
        assert f["left_on_model"] == [] and f["optimizer_own"] == [] and not f["moments_own"]
        assert f["backup_changed"] == []
        assert f["classes_unchanged_during_run"] and f["classes_unchanged_after"]
    assert found[0]["weights"] == found[1]["weights"]
    assert runner.leftovers() == []


def test_unparallelize_refuses_a_model_that_was_not_parallelized():
    import keras

    import multigpu

    with pytest.raises(ValueError, match=r"takes a model returned by multigpu\.parallelize"):
        multigpu.unparallelize(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
