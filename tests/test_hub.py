"""keras-hub tasks train through their own ``fit``/``evaluate``/``predict``: exact against one plain process.

``scripts/hub_tasks.py`` trains a ``BertTextClassifier`` with its tokenizing
preprocessor on strings and a ``GPT2CausalLM`` on token arrays with the
padding mask as sample weight, both built from a config; the task builds its
grain dataset and preprocesses each global batch on one rank per machine.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import SCRIPTS
from tests.test_inputs import BACKENDS, _input_files, load

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
pytest.importorskip("keras_hub", reason="keras-hub's tasks need keras-hub (make test installs it)")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One plain run per backend, made when a test first needs it."""
    made = {}

    def get(backend):
        if backend not in made:
            made[backend] = _reference(backend, tmp_path_factory.mktemp(f"hub-{backend}"))
        return made[backend]

    return get


def _reference(backend, folder, *extra):
    """One plain process's results (``extra``: more arguments of the script, e.g. its optimizer)."""
    if backend == "jax":
        pytest.importorskip("jax", reason="the JAX backend's tests need jax (make test installs it)")
    env = {**os.environ, **BACKENDS[backend], "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run([sys.executable, str(SCRIPTS / "hub_tasks.py"), str(folder / "plain.npz"), "--plain", *extra],
                         capture_output=True, check=False, text=True, timeout=150, env=env, cwd=folder)
    assert res.returncode == 0, res.stdout + res.stderr
    return load(folder / "plain.npz")


def _assert_one_devices(got, plain) -> None:
    """Both tasks' weights, History, evaluations and predictions within 1e-5 of one plain process's, and the same
    generated tokens."""
    for task in ("classifier", "lm"):
        assert np.abs(got[task] - plain[task]).max() <= 1e-5 * np.abs(plain[task]).max(), task
        for key, values in plain[f"{task}_history"].items():
            np.testing.assert_allclose(got[f"{task}_history"][key], values, rtol=1e-5, err_msg=f"{task} {key}")
        for key, value in plain[f"{task}_evaluate"].items():
            assert got[f"{task}_evaluate"][key] == pytest.approx(value, rel=1e-5), f"{task} {key}"
        np.testing.assert_allclose(got[f"{task}_predict"], plain[f"{task}_predict"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["lm_generate"], plain["lm_generate"])


# JAX at 3:1 only: three JAX ranks on two cores take a minute, and torch covers 1:2:5. JAX is an outside check
# (`make test-outside`): with its plain reference it took about 50 s of `make test`.
@pytest.mark.parametrize(("backend", "ratios"), [("torch", "3,1"), ("torch", "1,2,5"),
                                                 pytest.param("jax", "3,1", marks=pytest.mark.outside)])
def test_keras_hub_tasks_reproduce_one_device(runner, references, backend, ratios):
    plain = references(backend)
    n = len(ratios.split(","))
    out = runner.tmp_path / "par.npz"
    res = runner.cli("run", "--devices", ",".join(f"cpu:{i}" for i in range(n)), "--ratios", ratios,
                     str(SCRIPTS / "hub_tasks.py"), str(out), extra_env=BACKENDS[backend], timeout=200)
    assert res.returncode == 0, res.stdout
    got = load(out)
    _assert_one_devices(got, plain)
    # The task's own fit reached multigpu's through the model's own subclass: keras.Model stayed Keras's, the
    # save names the task's class, and unparallelize gives the model its class back.
    assert bool(got["keras_model_unchanged"])
    assert got["saved_as"] == "keras_hub>GPT2CausalLM"
    assert got["class_while_parallel"] == ["GPT2CausalLM", True] and bool(got["class_after"])
    # The task's preprocessing runs on rank 0 only, once per global batch; the other ranks run it once per
    # dataset the task builds (keras-hub's probe of the first batch: fit's two, evaluate's and predict's).
    assert int(got["preprocess_calls"]) > 4
    for r in range(1, n):
        other = load(f"{out}.rank{r}.npz")
        assert int(other["preprocess_calls"]) == 4
        for key in ("classifier", "lm", "classifier_predict", "lm_predict"):
            np.testing.assert_array_equal(other[key], got[key])
    assert runner.leftovers() == []
    assert not _input_files()


@pytest.mark.outside  # make test-outside: the weights in parts run in make test on the optimizer-features suite
@pytest.mark.timeout(400)
def test_keras_hub_tasks_fine_tuned_with_adamw_and_the_weights_in_parts_reproduce_one_device(runner, tmp_path):
    """The same tasks with AdamW, each device holding only its part of the weights while they train
    (``shard="weights"``): a BERT classifier on strings and a GPT-2 language model, both built from a config, their
    embeddings (GPT-2's used again, reversed, for its logits), attention and feed-forward layers each gathered
    for its call and its backward pass; every result within 1e-5 of one plain process's, greedy generation
    after ``fit`` (on every rank) the same tokens, the saved file the task's class."""
    plain = _reference("torch", tmp_path, "--optimizer", "adamw")
    out = runner.tmp_path / "par.npz"
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", "--ratios", "3,1", str(SCRIPTS / "hub_tasks.py"), str(out),
                     "--optimizer", "adamw", "--shard", "weights", extra_env=BACKENDS["torch"], timeout=200)
    assert res.returncode == 0, res.stdout
    assert "the weights in parts: CPU:0 owned" in res.stdout
    got = load(out)
    _assert_one_devices(got, plain)
    assert got["saved_as"] == "keras_hub>GPT2CausalLM"
    assert runner.leftovers() == []
