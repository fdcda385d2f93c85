"""A ``keras.applications`` model (``MobileNetV3Small``, ``weights=None``): exact against one plain process.

``scripts/applications.py`` trains it one epoch with ``sync_batchnorm=True``
(its BatchNormalization layers see the global batch's statistics).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import SCRIPTS
from tests.test_inputs import load

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def test_mobilenet_v3_small_reproduces_one_device_at_1_2_5(runner, tmp_path):
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run([sys.executable, str(SCRIPTS / "applications.py"), str(tmp_path / "plain.npz"), "--plain"],
                         capture_output=True, check=False, text=True, timeout=150, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    plain = load(tmp_path / "plain.npz")
    out = runner.tmp_path / "par.npz"
    res = runner.cli("run", "--devices", "cpu:0,cpu:1,cpu:2", "--ratios", "1,2,5", str(SCRIPTS / "applications.py"),
                     str(out), timeout=200)
    assert res.returncode == 0, res.stdout
    got = load(out)
    name = "MobileNetV3Small"
    assert np.abs(got[name] - plain[name]).max() <= 1e-5 * np.abs(plain[name]).max()
    for key, values in plain[f"{name}_history"].items():
        np.testing.assert_allclose(got[f"{name}_history"][key], values, rtol=1e-5, err_msg=key)
    for r in (1, 2):
        np.testing.assert_array_equal(load(f"{out}.rank{r}.npz")[name], got[name])
    assert runner.leftovers() == []
