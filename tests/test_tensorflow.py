"""The TensorFlow backend (``KERAS_BACKEND=tensorflow``): N devices reproduce one, on real processes.

The same checks as the torch backend's, against a plain TensorFlow process:
the mixed model at 3:1 (SGD; and with 16-bit gradients) and 1:2:5 (Adam) with a ragged last step
(:mod:`tests.test_exactness`), two outputs with sample weights, evaluate and
predict, global BatchNorm, callbacks and saving (:mod:`tests.test_keras`,
whose tests run here again with this module's runs), a ``train_step`` of the
model's own, a GAN trained with ``train_on_batch`` and every optimizer
feature (``tests/scripts/tensorflow_steps.py``), and ``model.export``.
"""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("tensorflow", reason="the TensorFlow backend's tests need TensorFlow (make test installs it)")

from tests.conftest import SCRIPTS, run_together
from tests.test_exactness import load as load_exactness
from tests.test_exactness import max_relative_error
from tests.test_keras import (  # noqa: F401  (test_keras's tests, run again on this module's `runs`)
    COMPARED,
    load,
    rel,
    test_callbacks_checkpoint_and_saved_model,
    test_sync_batchnorm_reproduces_one_device,
    test_two_outputs_sample_weight_evaluate_and_predict_match_one_device,
)
from tests.test_launch import read, torchrun_matches_one_machine
from tests.test_reliability import RUN, kill_rank_1_mid_epoch, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ENV = {"KERAS_BACKEND": "tensorflow", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
       "PYTHONWARNINGS": "default"}


def _run(args, cwd, timeout=240):
    res = subprocess.run(args, capture_output=True, check=False, text=True, timeout=timeout,
                         env={**os.environ, **ENV}, cwd=cwd)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def _together(*commands, cwd, timeout=240) -> list[str]:
    """:func:`_run` of each command at once (``tests.conftest.run_together``): their outputs."""
    done = run_together(*({"args": args, "env": {**os.environ, **ENV}, "cwd": cwd} for args in commands),
                        timeout=timeout)
    for res in done:
        assert res.returncode == 0, res.stdout[-3000:]
    return [res.stdout for res in done]


def _parallel_args(script, *args, devices="cpu:0,cpu:1") -> list[str]:
    return [sys.executable, "-m", "multigpu", "run", "--devices", devices, str(SCRIPTS / script), *args]


def _parallel(script, *args, cwd, devices="cpu:0,cpu:1"):
    return _run(_parallel_args(script, *args, devices=devices), cwd)


@pytest.mark.parametrize(("ratios", "optimizer"), [("3,1", "sgd"), ("1,2,5", "adam")])
def test_mixed_model_matches_one_device(tmp_path, ratios, optimizer):
    """Dense, Conv2D, GRU, Embedding (sparse gradients) and L2 on 193 rows at batch 64: the last step has
    one row, so at 3:1 one rank and at 1:2:5 two ranks have none. At 3:1 a third run sends its gradients in 16
    bits (``compression="bf16"``): near one device, every rank alike, and not exact (really 16 bits)."""
    n = len(ratios.split(","))

    def parallel(out: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "multigpu", "run", "--devices", ",".join(f"cpu:{i}" for i in range(n)),
                "--ratios", ratios, str(SCRIPTS / "exactness.py"), str(tmp_path / out), "--rows", "193",
                "--optimizers", optimizer, *extra]

    compressed = optimizer == "sgd"
    _together([sys.executable, str(SCRIPTS / "exactness.py"), str(tmp_path / "plain.npz"), "--plain", "--rows", "193",
               "--optimizers", optimizer], parallel("par.npz"),
              *([parallel("bf16.npz", "--compression", "bf16")] if compressed else []), cwd=tmp_path)
    tolerance = {"sgd": 1e-5, "adam": 1e-4}[optimizer]
    (ref, ref_history), (got, history) = (load_exactness(tmp_path / f, (optimizer,))[optimizer]
                                          for f in ("plain.npz", "par.npz"))
    assert max_relative_error(ref, got) <= tolerance
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=tolerance)
    np.testing.assert_allclose(history["accuracy"], ref_history["accuracy"], rtol=tolerance)
    for r in range(1, n):
        other, other_history = load_exactness(tmp_path / f"par.npz.rank{r}.npz", (optimizer,))[optimizer]
        assert max_relative_error(got, other) == 0.0 and other_history == history
    if compressed:
        half, half_history = load_exactness(tmp_path / "bf16.npz", (optimizer,))[optimizer]
        assert 1e-6 < max_relative_error(ref, half) <= 1e-2  # bf16 keeps 8 bits of mantissa
        np.testing.assert_allclose(half_history["loss"], ref_history["loss"], rtol=1e-2)
        other, _ = load_exactness(tmp_path / "bf16.npz.rank1.npz", (optimizer,))[optimizer]
        assert max_relative_error(half, other) == 0.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """test_keras's runs on TensorFlow: one plain process (eager: Keras's traced TensorFlow step weighs each
    output's loss by a batch size it may not know, and so misstates per-output losses on ragged batches) and
    one 2-device run (3:1) of every feature."""
    folder = tmp_path_factory.mktemp("tf-features")
    _, par = _together([sys.executable, str(SCRIPTS / "keras_features.py"), COMPARED, str(folder / "plain"), "--plain",
                        "--eager"], _parallel_args("keras_features.py", "all", str(folder / "par")), cwd=folder)
    return folder, par


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tf-steps")
    _together([sys.executable, str(SCRIPTS / "tensorflow_steps.py"), "all", str(folder / "plain"), "--plain"],
              _parallel_args("tensorflow_steps.py", "all", str(folder / "par")), cwd=folder)

    def pair(mode):
        return (load(folder / f"plain-{mode}.npz"), load(folder / f"par-{mode}.npz"),
                load(folder / f"par-{mode}.npz.rank1.npz"))

    return folder, pair


def test_a_train_step_of_its_own_matches_one_device_and_exports_from_rank_0(steps):
    folder, pair = steps
    plain, r0, r1 = pair("custom")
    assert rel(plain["weights"], r0["weights"]) < 1e-5
    np.testing.assert_array_equal(r0["weights"], r1["weights"])
    for key in ("loss", "mae", "seen"):  # a scalar log (rows-weighted), a metric, a Sum over every rank's rows
        np.testing.assert_allclose(r0["history"][key], plain["history"][key], rtol=1e-5)
    assert r0["history"] == r1["history"]
    # model.export on every rank: rank 0 wrote one SavedModel, which serves what the model predicts
    code = (f"import numpy as np, tensorflow as tf\nd = np.load({str(folder / 'par-custom.npz')!r})\n"
            f"m = tf.saved_model.load({str(folder / 'par-custom.npz.savedmodel')!r})\n"
            "np.testing.assert_allclose(m.serve(d['probe']).numpy(), d['pred'], rtol=1e-5, atol=1e-6)\n"
            "print('served ok')\n")
    assert "served ok" in _run([sys.executable, "-c", code], folder, timeout=60)
    assert not list(folder.glob(".*.tmp*")), "a temporary folder was left behind"


def test_a_gan_trained_with_train_on_batch_matches_one_device(steps):
    """Two optimizers in one train_step, one sum per optimizer call, in the step's order on every rank."""
    _, pair = steps
    plain, r0, r1 = pair("gan")
    assert rel(plain["weights"], r0["weights"]) < 1e-4  # Adam
    np.testing.assert_array_equal(r0["weights"], r1["weights"])
    assert r0["logs"] == r1["logs"] and len(r0["logs"]) == 6


# relative tolerance per feature: float32 rounding, or the 16-bit compute dtype's
FEATURE_TOLERANCE = {"mixed_float16": 1e-3, "mixed_bfloat16": 1e-2}


def test_every_optimizer_feature_matches_one_device(steps):
    _, pair = steps
    plain, r0, r1 = pair("features")
    names = [k.split(".")[0] for k in plain if k.endswith(".weights")]
    assert len(names) == 8
    for name in names:
        tolerance = FEATURE_TOLERANCE.get(name, 1e-5)
        assert rel(plain[f"{name}.weights"], r0[f"{name}.weights"]) < tolerance, name
        np.testing.assert_allclose(r0[f"{name}.loss"], plain[f"{name}.loss"], rtol=tolerance, err_msg=name)
        np.testing.assert_array_equal(r0[f"{name}.weights"], r1[f"{name}.weights"], err_msg=name)
        assert r0[f"{name}.optimizer"] == plain[f"{name}.optimizer"], name
    assert r0["mixed_float16.optimizer"] == ["LossScaleOptimizer"]


ON_TF = {k: v for k, v in ENV.items() if k != "PYTHONWARNINGS"}


def test_a_killed_rank_ends_the_tensorflow_run_naming_it(runner):
    kill_rank_1_mid_epoch(runner, ON_TF)


def test_a_rank_that_stops_answering_ends_the_tensorflow_run_within_the_timeout(runner):
    """The sum runs inside the step's graph (a numpy_function): its timeout must still end the run, naming it."""
    proc = runner.start([*RUN, "--timeout", "8", str(SCRIPTS / "tiny.py"), "--rows", "4000", "--batch", "16",
                         "--sleep-rank", "1", "--sleep", "60", "--timeout", "8"], ON_TF)
    wait_for(proc, r"rank 1 sleeps", timeout=90)
    slept_at = time.monotonic()
    res = runner.finish(proc, timeout=90)
    assert res.returncode == 1, res.stdout
    assert time.monotonic() - slept_at < 8 + 15
    assert re.search(r"rank 0 \(CPU:0\): summing gradients failed: TimeoutError: rank\(s\) \[1\] did not reach the "
                     r"collective within 8 s", res.stdout), res.stdout[-3000:]
    assert runner.leftovers() == []


def test_torchrun_two_machines_on_loopback_on_tensorflow(runner):
    """Several machines: torchrun starts each rank through multigpu's entry, which binds TensorFlow and joins
    before the script runs; the result equals a one-machine run's."""
    torchrun_matches_one_machine(runner, ON_TF, through_entry=True)


def test_a_model_built_by_fit_trains_as_on_one_device(runner):
    """A Sequential without an Input is built by the first batch: every variable must be in the step (Keras's
    own SwapEMAWeights and constraint tests found a model whose variables came too late to be trained)."""
    args = [str(SCRIPTS / "tiny.py"), "--unbuilt", "--rows", "64", "--batch", "16", "--epochs", "2"]
    one, two = runner.together(([sys.executable, *args, "--devices", "cpu:0", "--out", "one"], ON_TF),
                               ([*RUN, *args, "--ratios", "3,1", "--out", "two"], ON_TF), timeout=120)
    assert one.returncode == 0, one.stdout
    assert two.returncode == 0, two.stdout
    ref, got = read(runner, "one", 0), read(runner, "two", 0)
    assert got["world_size"] == 2
    for a, b in zip(got["weights"], ref["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert got["weights"] == read(runner, "two", 1)["weights"]
    assert runner.leftovers() == []
