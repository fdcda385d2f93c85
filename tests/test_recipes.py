"""The training recipes' example (``examples/training_recipes.py``, ``docs/guides/training.md``) as a user runs it:
two devices at 3:1 against one device, on real processes.

Gradient accumulation (four steps a update) with TensorBoard logs: the saved
weights equal one device's (1e-5), and rank 0 alone wrote one events file
whose epoch losses are one device's.  Mixed precision (``mixed_float16``, loss
scaling): the example runs on two devices, and each step's update equals one
device's update from the same weights to float16 rounding (at most 2e-3 of
the largest update: float16 keeps 11 bits, 9.8e-4), checked step by step on
an MLP at two splits (``tests/scripts/splits.py``).  End to end, float16
rounding grows over steps as it does on one device (1.6e-2 after eight steps
with momentum 0.9 at 32 + 32 rows, 3e-4 at 48 + 16).
"""

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).parent.parent / "examples" / "training_recipes.py"

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _weights(path: Path) -> list[np.ndarray]:
    found: list[np.ndarray] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: found.append(np.array(item)) if isinstance(item, h5py.Dataset) else None)
    return found


def _difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b) > 0
    return max(float(np.max(np.abs(x - y)) / max(np.max(np.abs(x)), 1e-12)) for x, y in zip(a, b))


def _command(devices: str, out: str, *args: str) -> list[str]:
    command = [sys.executable, str(EXAMPLE), "--quick", "--devices", devices, "--out", out, *args]
    if "," in devices:
        command = [sys.executable, "-m", "multigpu", "run", "--devices", devices, "--ratios", "3,1", *command[1:]]
    return command


def _run(runner, devices: str, out: str, *args: str) -> str:
    res = runner.run(_command(devices, out, *args), timeout=240, extra_env=QUIET)
    assert res.returncode == 0, res.stdout[-3000:]
    return res.stdout


def _epoch_losses(folder: Path) -> list[float]:
    import tensorflow as tf

    files = sorted((folder / "train").glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 alone wrote
    losses = []
    for event in tf.compat.v1.train.summary_iterator(str(files[0])):
        for value in event.summary.value:
            if value.tag == "epoch_loss":
                losses.append(float(tf.make_ndarray(value.tensor)))
    return losses


def test_gradient_accumulation_and_tensorboard_from_rank_0_equal_one_device(runner):
    pytest.importorskip("tensorboard", reason="Keras's TensorBoard callback needs tensorboard (make test installs it)")
    done = runner.together((_command("cpu:0", "one.weights.h5", "--accumulate", "4", "--tensorboard", "one"), QUIET),
                           (_command("cpu:0,cpu:1", "two.weights.h5", "--accumulate", "4", "--tensorboard", "two"),
                            QUIET), timeout=240)  # one device and two at once
    for res in done:
        assert res.returncode == 0, res.stdout[-3000:]
    one, two = (res.stdout for res in done)
    assert "accumulating 4 step(s)" in one and two.count("final loss") == 1, two[-3000:]
    weights = [_weights(runner.tmp_path / f"{name}.weights.h5") for name in ("one", "two")]
    assert _difference(*weights) <= 1e-5
    ref, got = _epoch_losses(runner.tmp_path / "one"), _epoch_losses(runner.tmp_path / "two")
    assert len(got) == 3
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert runner.leftovers() == []


def test_mixed_precision_steps_equal_one_devices_to_float16_rounding(runner):
    two = _run(runner, "cpu:0,cpu:1", "two.weights.h5", "--mixed-precision", "--epochs", "1")
    assert "LossScaleOptimizer, policy mixed_float16" in two and two.count("final loss") == 1, two[-3000:]
    out = runner.tmp_path / "steps.json"
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", str(SCRIPTS / "splits.py"), str(out), "--splits", "32,32",
                     "48,16", "--rows", "640", "--epochs", "1", "--policy", "mixed_float16", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:]
    for split, got in json.loads(out.read_text()).items():
        assert got["steps"] == 10 and 0 < got["step_error"] <= 2e-3, (split, got)
    assert runner.leftovers() == []
