"""N devices with any shares reproduce the single-device run (real processes).

Each run trains a model with Dense, Conv2D, GRU, Embedding layers and an L2
regulariser on 193 rows at global batch 64 with shuffle=False, so the last
step is ragged (1 row: with ratios 3:1 rank 1 gets none).
"""

import json

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

ROWS = "193"
_reference_cache: dict = {}


def load(path):
    data = np.load(path)
    weights = [data[k] for k in data.files if k != "history"]
    return weights, json.loads(str(data["history"]))


def max_relative_error(a, b) -> float:
    return max(float(np.abs(x - y).max() / (np.abs(x).max() + 1e-12)) for x, y in zip(a, b))


def reference(runner, optimizer):
    if optimizer not in _reference_cache:
        out = runner.tmp_path / f"plain-{optimizer}.npz"
        res = runner.script("exactness.py", str(out), "--plain", "--optimizer", optimizer, "--rows", ROWS)
        assert res.returncode == 0, res.stdout
        _reference_cache[optimizer] = load(out)
    return _reference_cache[optimizer]


@pytest.mark.parametrize(
    ("ratios", "optimizer", "tolerance"),
    [
        ("1,1", "sgd", 1e-5),
        ("3,1", "sgd", 1e-5),
        ("3,1", "adam", 1e-4),
        ("1,2,5", "sgd", 1e-5),
        ("1,2,5", "adam", 1e-4),
    ],
)
def test_parallel_run_matches_single_device(runner, ratios, optimizer, tolerance):
    ref_weights, ref_history = reference(runner, optimizer)
    n = len(ratios.split(","))
    devices = ",".join(f"cpu:{i}" for i in range(n))
    out = runner.tmp_path / "par.npz"
    res = runner.script(
        "exactness.py", str(out), "--devices", devices, "--ratios", ratios,
        "--optimizer", optimizer, "--rows", ROWS,
    )
    assert res.returncode == 0, res.stdout
    weights, history = load(out)
    assert max_relative_error(ref_weights, weights) <= tolerance
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], ref_history[key], rtol=tolerance)
    # every rank ends with the same weights and the same (global) history
    for r in range(1, n):
        w_r, h_r = load(f"{out}.rank{r}.npz")
        assert max_relative_error(weights, w_r) == 0.0
        assert h_r == history
    assert runner.leftovers() == []


def test_multigpu_run_launcher_matches_single_device(runner):
    ref_weights, _ = reference(runner, "sgd")
    out = runner.tmp_path / "run.npz"
    from tests.conftest import SCRIPTS

    res = runner.cli("run", "--devices", "cpu:0,cpu:1", "--ratios", "1,3",
                     str(SCRIPTS / "exactness.py"), str(out), "--rows", ROWS)
    assert res.returncode == 0, res.stdout
    weights, _ = load(out)
    assert max_relative_error(ref_weights, weights) <= 1e-5
