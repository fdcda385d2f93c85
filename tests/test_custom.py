"""Custom training (train_step and compute_loss overrides, train_on_batch loops), unused parameters,
frozen models and callback counts: N devices against one plain process (tests/scripts/custom.py)."""

import json
import sys

import numpy as np
import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

MODES = ("gan", "vae", "vae_step", "distiller", "on_batch", "unused", "frozen", "counts", "scaled")


def load(path) -> dict:
    data = np.load(path)
    out: dict = {}
    for key in data.files:
        mode, name = key.split(".", 1)
        out.setdefault(mode, {})[name] = json.loads(str(data[key])) if name == "history" else data[key]
    return out


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / (np.abs(a).max() + 1e-12)) if a.size else 0.0


def close(a, b, tolerance: float) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tolerance) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y, tolerance) for x, y in zip(a, b))
    return abs(a - b) <= tolerance * max(1.0, abs(a))


@pytest.mark.parametrize(("devices", "ratios", "transport"),
                         [("cpu:0,cpu:1", "3,1", "gloo"), ("cpu:0,cpu:1,cpu:2", "1,2,5", "shm")])
def test_custom_steps_match_one_device(runner, devices, ratios, transport):
    """Over gloo with overlap asked for (off by default for CPU ranks of one machine), the gradient sums start
    during the backward pass: every custom step stays exact with them.  One device's run goes beside it."""
    out, reference = runner.tmp_path / "par.npz", runner.tmp_path / "plain.npz"
    one, res = runner.together(
        ([sys.executable, str(SCRIPTS / "custom.py"), str(reference), "--plain"], None),
        ([sys.executable, "-m", "multigpu", "run", "--devices", devices, "--ratios", ratios, str(SCRIPTS / "custom.py"),
          str(out), "--devices", devices, "--ratios", ratios],
         {"MULTIGPU_TRANSPORT": transport, "MULTIGPU_OVERLAP": "1" if transport == "gloo" else ""}), timeout=200)
    assert one.returncode == 0, one.stdout[-4000:]
    assert res.returncode == 0, res.stdout[-4000:]
    plain, got = load(reference), load(out)
    others = [load(f"{out}.rank{r}.npz") for r in range(1, len(devices.split(",")))]
    assert set(got) == set(MODES)
    for mode in MODES:
        for key, value in plain[mode].items():
            if key == "history":
                assert close(value, got[mode][key], 1e-5), (mode, value, got[mode][key])
            else:
                assert rel(value, got[mode][key]) <= 1e-5, (mode, key)
            for other in others:  # every rank holds the same weights and the same global logs
                if key == "history":
                    assert other[mode][key] == got[mode][key], mode
                else:
                    np.testing.assert_array_equal(other[mode][key], got[mode][key])
    counts = got["counts"]["history"]
    assert counts["counts"] == [12, 6 + 5, 4]  # one callback per global batch, as on one device
    assert counts["predict_indexes"] == [0, 1, 2, 3]
    assert got["frozen"]["history"]["warned"] == [1.0]  # "The model does not have any trainable weights."
    # Two optimizers, two backward passes: both calls' sums start during their backward pass over gloo.
    assert bool(got["gan"]["overlap"]) == (transport == "gloo")
    # Gradients changed after the backward pass: the step sums them again (exact above), and overlap stays off.
    assert not bool(got["scaled"]["overlap"])
    assert runner.leftovers() == []
