"""Real loaders with workers on real processes: exact against one plain process on both backends.

``scripts/inputs.py`` trains from a ``PyDataset`` read by worker threads, a
``DataLoader`` with worker processes and a seeded shuffle, and a generator
(batches of two sizes, across epochs), then evaluates and predicts; the global
batch of 32 leaves a ragged last batch of 26 rows, where at 1:2:5 a rank has
3 rows.
"""

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

BACKENDS = {"torch": {"KERAS_BACKEND": "torch"},
            "jax": {"KERAS_BACKEND": "jax", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}}
KINDS = ("pydataset", "dataloader", "generator")


def load(path):
    data = np.load(path)
    return {k: json.loads(str(data[k])) if data[k].dtype.kind == "U" else data[k] for k in data.files}


def rel(a, b):
    return float(np.abs(a - b).max() / (np.abs(a).max() + 1e-12))


def plain_run(script: str, backend: str, folder, timeout: float, extra_env: dict | None = None) -> dict:
    """``scripts/<script> OUT --plain`` on one device in ``folder``: its results."""
    if backend == "jax":
        pytest.importorskip("jax", reason="the JAX backend's tests need jax (make test installs it)")
    env = {**os.environ, **BACKENDS[backend], "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(extra_env or {})}
    res = subprocess.run([sys.executable, str(SCRIPTS / script), str(folder / "plain.npz"), "--plain"],
                         capture_output=True, check=False, text=True, timeout=timeout, env=env, cwd=folder)
    assert res.returncode == 0, res.stdout + res.stderr
    return load(folder / "plain.npz")


def assert_reproduces(runner, script: str, backend: str, plain: dict | None, ratios: str, kinds, timeout: float,
                      extra_env: dict | None = None) -> None:
    """``scripts/<script>`` on CPU devices at ``ratios`` equals the one-device run ``plain`` (None: run beside it;
    weights and History of every kind, evaluation, predictions) to 1e-5, every rank ends alike, and nothing is
    left behind."""
    n = len(ratios.split(","))
    out = runner.tmp_path / "par.npz"
    run = [sys.executable, "-m", "multigpu", "run", "--devices", ",".join(f"cpu:{i}" for i in range(n)), "--ratios",
           ratios, str(SCRIPTS / script), str(out)]
    env = {**BACKENDS[backend], **(extra_env or {})}
    if plain is None:  # the one-device run beside this one, at once
        reference = runner.tmp_path / "plain.npz"
        one, res = runner.together(([sys.executable, str(SCRIPTS / script), str(reference), "--plain"], env),
                                   (run, env), timeout=timeout)
        assert one.returncode == 0, one.stdout
        plain = load(reference)
    else:
        res = runner.run(run, timeout, env)
    assert res.returncode == 0, res.stdout
    got = load(out)
    for kind in kinds:
        assert rel(plain[kind], got[kind]) < 1e-5, kind
        for key, values in plain[f"{kind}_history"].items():
            np.testing.assert_allclose(got[f"{kind}_history"][key], values, rtol=1e-5, err_msg=f"{kind} {key}")
    for key, value in plain["evaluate"].items():
        assert got["evaluate"][key] == pytest.approx(value, rel=1e-5)
    np.testing.assert_allclose(got["predict"], plain["predict"], rtol=1e-5, atol=1e-6)
    for r in range(1, n):  # every rank ends with the same weights, History and predictions
        other = load(f"{out}.rank{r}.npz")
        for key in (*kinds, "predict"):
            np.testing.assert_array_equal(other[key], got[key])
    assert runner.leftovers() == []
    assert not _input_files()


@pytest.fixture(scope="module", params=list(BACKENDS))
def reference(request, tmp_path_factory):
    backend = request.param
    return backend, plain_run("inputs.py", backend, tmp_path_factory.mktemp(f"inputs-{backend}"), 150)


@pytest.mark.parametrize("ratios", ["3,1", "1,2,5"])
def test_loaders_with_workers_reproduce_one_device(runner, reference, ratios):
    backend, plain = reference
    assert_reproduces(runner, "inputs.py", backend, plain, ratios, KINDS, 200)


def _input_files() -> list[str]:
    """Batch files left in shared memory by any run (none may be)."""
    from multigpu.data.exchange import directory

    return [f for f in os.listdir(directory()) if f.startswith("multigpu-in-")]


@pytest.mark.parametrize(("mode", "expected"), [
    ("pyds_worker", r"InputError: reading global batch \d+ of this pass failed on rank \d \(CPU:\d\): "
                    r"OSError: cannot read batch 3"),
    # make test-outside: an error in a PyDataset's worker stays (the same reader's path to the rank's end)
    pytest.param("loader_worker",
                 r"rank \d \(CPU:\d\) exited with code 1: OSError: Caught OSError in DataLoader worker",
                 marks=pytest.mark.outside),
])
def test_an_error_in_a_loader_worker_ends_the_run_naming_the_rank_and_the_error(runner, mode, expected):
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", str(SCRIPTS / "input_failures.py"), mode, timeout=90)
    assert res.returncode == 1, res.stdout
    assert re.search(expected, res.stdout), res.stdout[-3000:]
    assert "cannot read" in res.stdout  # the original error's text and traceback reach the output
    assert runner.leftovers() == []  # the loaders' worker threads and processes ended with their ranks
    assert not _input_files()


def test_a_machine_whose_input_runs_out_early_ends_the_run_with_a_clear_error(runner):
    """Two machines (torchrun's variables, one rank each) reading their own generators; machine 1's is short."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [runner.start([sys.executable, str(SCRIPTS / "input_failures.py"), "short"], extra_env={
        "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo"}) for r in range(2)]
    for res in [runner.finish(p, timeout=90) for p in ranks]:
        assert res.returncode != 0
        assert ("the input ran out after 4 batches on rank(s) [1] while rank(s) [0] still had batch 4"
                in res.stdout), res.stdout[-3000:]
    assert runner.leftovers() == []


ARRAY_BACKENDS = {**BACKENDS, "tensorflow": {"KERAS_BACKEND": "tensorflow"}}


@pytest.mark.parametrize("backend", list(ARRAY_BACKENDS))
def test_pandas_jax_and_tensorflow_arrays_reproduce_one_device_on_numpy(runner, backend, monkeypatch):
    """fit on the backend's own arrays (pandas on torch, ``jax.Array`` on JAX, ``tf.Tensor`` on TensorFlow),
    validation on a DataFrame and a Series, ``jax.Array``s for evaluate and a ``tf.Tensor`` for predict take the
    arrays' path and give what plain Keras gives on the same NumPy arrays."""
    for module in ("pandas", "jax", "tensorflow"):
        pytest.importorskip(module, reason="make test installs pandas, jax and tensorflow-cpu")
    monkeypatch.setitem(BACKENDS, "tensorflow", ARRAY_BACKENDS["tensorflow"])
    out = runner.tmp_path / "par.npz"
    script = str(SCRIPTS / "array_forms.py")
    for res in runner.together(  # one device and two at once
            ([sys.executable, script, str(runner.tmp_path / "plain.npz"), "--plain"], ARRAY_BACKENDS[backend]),
            ([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0", "cpu:1", "--ratios", "3,1", script,
              str(out)], ARRAY_BACKENDS[backend]), timeout=150):
        assert res.returncode == 0, res.stdout
    plain, got = load(runner.tmp_path / "plain.npz"), load(out)
    assert rel(plain["weights"], got["weights"]) < 1e-5
    for key, values in plain["history"].items():
        np.testing.assert_allclose(got["history"][key], values, rtol=1e-5, err_msg=key)
    for key, value in plain["evaluate"].items():
        assert got["evaluate"][key] == pytest.approx(value, rel=1e-5)
    np.testing.assert_allclose(got["predict"], plain["predict"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(load(f"{out}.rank1.npz")["weights"], got["weights"])
    assert runner.leftovers() == []
