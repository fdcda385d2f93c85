"""tf.data pipelines and Keras's ``image_dataset_from_directory`` on real processes: exact against one device.

``scripts/tfdata.py`` trains from a mapped, shuffled and prefetched pipeline with a ragged last batch and a
``tf.data`` validation set, from a ``repeat()``-ed one with ``steps_per_epoch``, and from
``image_dataset_from_directory``, ``text_dataset_from_directory`` and ``audio_dataset_from_directory``
with ``validation_split``, and ``timeseries_dataset_from_array``; then evaluates and predicts on datasets.  Needs
TensorFlow (``make test`` installs ``tensorflow-cpu``).
"""

import pytest

from tests.conftest import SCRIPTS
from tests.test_inputs import BACKENDS, _input_files, assert_reproduces

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
pytest.importorskip("tensorflow", reason="the tf.data tests need TensorFlow (make test installs tensorflow-cpu)")

KINDS = ("map", "repeat", "text", "timeseries", "audio", "images", "images_grain")
QUIET_TF = {"TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize(("backend", "ratios"), [(b, r) for b in BACKENDS for r in ("3,1", "1,2,5")])
def test_tf_data_pipelines_reproduce_one_device(runner, backend, ratios):
    if backend == "jax":
        pytest.importorskip("jax", reason="the JAX backend's tests need jax (make test installs it)")
    assert_reproduces(runner, "tfdata.py", backend, None, ratios, KINDS, 250, QUIET_TF)


def test_an_error_in_a_map_function_ends_the_run_naming_the_rank_and_the_error(runner):
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", str(SCRIPTS / "tfdata.py"), str(runner.tmp_path / "x.npz"),
                     "--fail", extra_env=QUIET_TF, timeout=120)
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
