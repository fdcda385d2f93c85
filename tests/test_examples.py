"""The examples under examples/, each run with --quick in fresh processes; the tests check what they print."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.test_notebook import BACKENDS, run_notebook

pytestmark = pytest.mark.multiprocess

EXAMPLES = Path(__file__).parent.parent / "examples"
TWO_CPUS = ["--devices", "cpu:0,cpu:1"]
NUMBER = r"(\d+(?:\.\d+)?)"


# The examples the TensorFlow backend runs too (issue 39: the migration, the ratios example, the 41M dense network,
# the GRU sweep); make demo runs there with KERAS_BACKEND=tensorflow.
ON = {"torch": {}, "tensorflow": {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}}


def on(backend: str) -> dict:
    if backend == "tensorflow":
        pytest.importorskip("tensorflow", reason="needs TensorFlow (make test-examples installs it)")
    return ON[backend]


def run_example(runner, name: str, *args: str, timeout: float, extra_env: dict | None = None) -> str:
    res = runner.run([sys.executable, str(EXAMPLES / name), "--quick", *args], timeout=timeout, extra_env=extra_env)
    assert res.returncode == 0, res.stdout[-5000:]
    return res.stdout


@pytest.mark.timeout(150)
def test_mnist_convnet_compares_one_device_with_all(runner):
    out = run_example(runner, "mnist_convnet.py", *TWO_CPUS, timeout=140)
    rows = {m[1]: (float(m[2]), float(m[3]), m[4]) for m in re.finditer(
        rf"^(one device: CPU:0|2 devices: CPU:0,CPU:1) +{NUMBER} +{NUMBER} +(\S+)$", out, re.M)}
    assert set(rows) == {"one device: CPU:0", "2 devices: CPU:0,CPU:1"}, out
    real_data = "falling back to synthetic data" not in out
    for seconds, accuracy, _ in rows.values():
        assert seconds > 0
        assert accuracy > (0.3 if real_data else 0.0), out  # 10 classes: chance is 0.1
    assert rows["one device: CPU:0"][2] == "1.00x"
    speedup = re.search(rf"^speedup: {NUMBER}x with 2 devices", out, re.M)
    assert speedup and float(speedup[1]) > 0, out
    assert runner.leftovers() == []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", list(ON))
def test_gru_sequences_prints_a_row_per_batch_size_and_device_count(runner, backend):
    out = run_example(runner, "gru_sequences.py", *TWO_CPUS, "--batch-sizes", "256", "--rows", "1024",
                      timeout=140, extra_env=on(backend))
    assert "| batch size | devices | accuracy | validation accuracy | time (s) | speed up |" in out
    rows = [m.groups() for m in re.finditer(
        rf"^\| (\d+) \| (\d+) \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER} \|$", out, re.M)]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(256, 1), (256, 2)], out  # each row starts processes
    for _, devices, accuracy, val_accuracy, seconds, speedup in rows:
        assert 0 <= float(accuracy) <= 1 and 0 <= float(val_accuracy) <= 1
        assert float(seconds) > 0 and float(speedup) > 0
        if devices == "1":
            assert float(speedup) == 1.0
    assert runner.leftovers() == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", list(ON))
def test_maxing_calibrates_and_reports_samples_per_second(runner, backend):
    profile = runner.tmp_path / "profile.json"
    out = run_example(runner, "maxing.py", "--devices", "cpu:0,cpu:1@0.5", "--recalibrate",
                      "--profile", str(profile), timeout=110, extra_env=on(backend))
    found = re.search(rf"^calibration found: CPU:0 {NUMBER} samples/s, CPU:1@0.5 {NUMBER} samples/s -> ratios",
                      out, re.M)
    assert found, out
    assert float(found[2]) < float(found[1]), out  # the half-speed device measures slower
    assert "where the time went in epoch 1" in out
    for device in ("CPU:0", r"CPU:1@0\.5", "total"):
        rate = re.search(rf"^{device} +\d+% +\d+ +{NUMBER}$", out, re.M)
        assert rate and float(rate[1]) > 0, (device, out)
    assert profile.exists()
    assert runner.leftovers() == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", list(ON))
def test_dense41m_scales_the_batch_with_the_devices(runner, backend):
    out = run_example(runner, "dense41m.py", *TWO_CPUS, timeout=110, extra_env=on(backend))
    rows = {m[1].strip(): (int(m[2]), m[3], float(m[4]), float(m[5])) for m in re.finditer(
        rf"^(1 device|2 devices, same batch|2 devices, batch x2) +(\d+) +([\d/]+) +{NUMBER} +{NUMBER}x$",
        out, re.M)}
    assert set(rows) == {"1 device", "2 devices, same batch", "2 devices, batch x2"}, out
    assert rows["1 device"][:2] == (32, "32")
    assert rows["2 devices, same batch"][:2] == (32, "16/16")
    assert rows["2 devices, batch x2"][:2] == (64, "32/32")
    for _, _, rate, speedup in rows.values():
        assert rate > 0 and speedup > 0
    assert re.search(r"^scaled batch: \d+\.\d\dx the samples/s of one device on 2 devices", out, re.M), out
    assert runner.leftovers() == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", list(ON))
def test_migrated_multi_gpu_model_script_trains_saves_and_loads(runner, backend):
    out = run_example(runner, "migrate_from_multi_gpu_model.py", "--gpus", "2", "--ratios", "3,1", timeout=80,
                      extra_env=on(backend))
    assert "multigpu: 2 device(s): CPU:0 75%, CPU:1 25%" in out, out
    assert "parallel_model is template: True" in out
    assert "predictions match: True" in out, out
    assert (runner.tmp_path / "migrated_model.keras").is_file()
    source = (EXAMPLES / "migrate_from_multi_gpu_model.py").read_text()
    assert "# from keras.utils import multi_gpu_model" in source
    assert "\nfrom multigpu import multi_gpu_model\n" in source
    assert runner.leftovers() == []


@pytest.mark.timeout(60)
def test_examples_reject_bad_ratios(runner):
    res = runner.run([sys.executable, str(EXAMPLES / "gru_sequences.py"), "--ratios", "3,x"], timeout=50)
    assert res.returncode == 2, res.stdout
    assert "--ratios takes 'auto' or numbers" in res.stdout


@pytest.mark.timeout(150)
def test_gan_trains_with_a_custom_step_and_saves_the_generator(runner):
    out = run_example(runner, "gan.py", *TWO_CPUS, "--ratios", "3,1", timeout=140)
    assert "2 device(s): CPU:0, CPU:1" in out, out
    losses = re.search(rf"^final losses: d_loss {NUMBER}, g_loss {NUMBER}$", out, re.M)
    assert losses and 0 < float(losses[1]) < 10 and 0 < float(losses[2]) < 10, out
    assert re.search(r"^discriminator right on \d+% of real test images and \d+% of generated ones$", out, re.M)
    generator = runner.tmp_path / "gan-generator.keras"
    assert generator.is_file() and (runner.tmp_path / "gan-samples.png").is_file()
    check = runner.run([sys.executable, "-c", "import keras, sys; m = keras.saving.load_model(sys.argv[1]); "
                        "print(tuple(m(keras.random.normal((2, 64))).shape))", str(generator)], timeout=60)
    assert "(2, 28, 28, 1)" in check.stdout, check.stdout
    assert runner.leftovers() == []


@pytest.mark.timeout(200)
def test_keras_hub_classifier_trains_from_strings_and_saves_the_task(runner):
    pytest.importorskip("keras_hub", reason="needs keras-hub (make test installs it)")
    out = run_example(runner, "keras_hub_classifier.py", *TWO_CPUS, "--ratios", "3,1", timeout=190)
    assert "2 device(s): CPU:0 75%, CPU:1 25%" in out, out
    accuracy = re.search(rf"^test accuracy: {NUMBER}$", out, re.M)
    assert accuracy and float(accuracy[1]) > 0.6, out  # two balanced classes: chance is 0.5
    assert len(re.findall(r"^  \d\.\d\d good: ", out, re.M)) == 3, out
    saved = runner.tmp_path / "bert-classifier.keras"
    assert saved.is_file()
    check = runner.run([sys.executable, "-c", "import keras, keras_hub, sys; m = keras.saving.load_model(sys.argv[1]); "
                        "print(m.predict(['good great film'], verbose=0).shape)", str(saved)], timeout=90)
    assert "(1, 2)" in check.stdout, check.stdout + check.stderr
    assert runner.leftovers() == []


@pytest.mark.timeout(200)
def test_image_folder_trains_from_image_files_with_keras_dataset_utility(runner):
    pytest.importorskip("tensorflow", reason="needs TensorFlow for tf.data (make test-examples installs it)")
    folder = runner.tmp_path / "images"
    out = run_example(runner, "image_folder.py", *TWO_CPUS, "--ratios", "3,1", "--folder", str(folder), timeout=190)
    assert "2 device(s): CPU:0 75%, CPU:1 25%" in out, out
    assert len(list(folder.glob("*/*.png"))) == 2000  # 10 classes of 200 files, written once for every rank
    accuracy = re.search(rf"^validation accuracy: {NUMBER}$", out, re.M)
    assert accuracy and float(accuracy[1]) > 0.3, out  # ten classes: chance is 0.1
    assert re.search(r"^first predictions: (\S+, ){4}\S+$", out, re.M), out
    assert runner.leftovers() == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_example_notebook_compares_one_device_with_all(runner, backend):
    """examples/notebook.ipynb in a real Jupyter kernel, quick mode (scripts/notebook.py)."""
    pytest.importorskip("nbclient", reason="the notebook needs nbclient and ipykernel (make test installs them)")
    if backend == "jax":
        pytest.importorskip("jax")
    cells = run_notebook(runner, "example", "--backend", backend, extra_env=BACKENDS[backend], timeout=230)
    assert not [c["errors"] for c in cells if c["errors"]]
    table = cells[-1]["text"]
    rows = re.findall(r"^(one device: CPU:0|2 devices: CPU:0,CPU:1) +(\S+) +(\S+) +(\S+)x$", table, re.M)
    assert [r[0] for r in rows] == ["one device: CPU:0", "2 devices: CPU:0,CPU:1"], table
    real = "data: Fashion-MNIST" in table
    for _, seconds, accuracy, _ in rows:
        assert float(seconds) > 0 and float(accuracy) > (0.3 if real else 0.0)
    assert runner.leftovers() == []
