"""tf.data pipelines and Keras's ``image_dataset_from_directory`` on real processes: exact against one device.

``scripts/tfdata.py`` trains from a mapped, shuffled and prefetched pipeline with a ragged last batch and a
``tf.data`` validation set, from a ``repeat()``-ed one with ``steps_per_epoch``, and from
``image_dataset_from_directory``, ``text_dataset_from_directory`` and ``audio_dataset_from_directory``
with ``validation_split``, and ``timeseries_dataset_from_array``; then evaluates and predicts on datasets.  Needs
TensorFlow (``make test`` installs ``tensorflow-cpu``).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import SCRIPTS
from tests.test_inputs import BACKENDS, _input_files, load, rel

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
pytest.importorskip("tensorflow", reason="the tf.data tests need TensorFlow (make test installs tensorflow-cpu)")

KINDS = ("map", "repeat", "text", "timeseries", "audio", "images", "images_grain")


@pytest.fixture(scope="module", params=list(BACKENDS))
def reference(request, tmp_path_factory):
    backend = request.param
    if backend == "jax":
        pytest.importorskip("jax", reason="the JAX backend's tests need jax (make test installs it)")
    folder = tmp_path_factory.mktemp(f"tfdata-{backend}")
    env = {**os.environ, **BACKENDS[backend], "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    res = subprocess.run([sys.executable, str(SCRIPTS / "tfdata.py"), str(folder / "plain.npz"), "--plain"],
                         capture_output=True, check=False, text=True, timeout=200, env=env, cwd=folder)
    assert res.returncode == 0, res.stdout + res.stderr
    return backend, load(folder / "plain.npz")


@pytest.mark.parametrize("ratios", ["3,1", "1,2,5"])
def test_tf_data_pipelines_reproduce_one_device(runner, reference, ratios):
    backend, plain = reference
    n = len(ratios.split(","))
    out = runner.tmp_path / "par.npz"
    res = runner.cli("run", "--devices", ",".join(f"cpu:{i}" for i in range(n)), "--ratios", ratios,
                     str(SCRIPTS / "tfdata.py"), str(out), extra_env={**BACKENDS[backend], "TF_CPP_MIN_LOG_LEVEL": "2"},
                     timeout=250)
    assert res.returncode == 0, res.stdout
    got = load(out)
    for kind in KINDS:
        assert rel(plain[kind], got[kind]) < 1e-5, kind
        for key, values in plain[f"{kind}_history"].items():
            np.testing.assert_allclose(got[f"{kind}_history"][key], values, rtol=1e-5, err_msg=f"{kind} {key}")
    for key, value in plain["evaluate"].items():
        assert got["evaluate"][key] == pytest.approx(value, rel=1e-5)
    np.testing.assert_allclose(got["predict"], plain["predict"], rtol=1e-5, atol=1e-6)
    for r in range(1, n):  # every rank ends with the same weights, History and predictions
        other = load(f"{out}.rank{r}.npz")
        for key in (*KINDS, "predict"):
            np.testing.assert_array_equal(other[key], got[key])
    assert runner.leftovers() == []
    assert not _input_files()


def test_an_error_in_a_map_function_ends_the_run_naming_the_rank_and_the_error(runner):
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", str(SCRIPTS / "tfdata.py"), str(runner.tmp_path / "x.npz"),
                     "--fail", extra_env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=120)
    assert res.returncode == 1, res.stdout
    assert "reading global batch 0 of this pass failed on rank 0 (CPU:0)" in res.stdout, res.stdout[-3000:]
    assert "cannot decode row" in res.stdout  # the original error reaches the output
    assert runner.leftovers() == []
    assert not _input_files()


def test_strings_in_a_dataset_are_refused_before_any_batch_is_read():
    import tensorflow as tf

    from multigpu.data.tfdata import check_element_spec

    ds = tf.data.Dataset.from_tensor_slices(({"text": ["a", "b"], "n": [1, 2]}, [0, 1])).batch(2)
    with pytest.raises(ValueError, match=r"^Invalid dtype: object\. fit: the dataset's element \[0\]\['text'\] holds "
                       r"strings \(tf.string\)"):  # Keras's own error type and words, then which element and why
        check_element_spec(ds, "fit")
    ragged = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1, 2], [3]])).batch(2)
    with pytest.raises(ValueError, match=r"Invalid dtype: object.*a ragged tensor"):
        check_element_spec(ragged, "fit")
    check_element_spec(tf.data.Dataset.from_tensor_slices(([1.0, 2.0], [0, 1])).batch(2), "fit")  # numbers pass
