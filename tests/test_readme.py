"""The README's quickstart, run as written on two CPU devices, and the README kept to one screenful of topics."""

import re

import pytest

from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

README = SCRIPTS.parents[1] / "README.md"


def quickstart() -> str:
    found = re.search(r"<!-- quickstart -->\n```python\n(.*?)```\n<!-- /quickstart -->", README.read_text(), re.S)
    assert found, "README.md lost its quickstart block"
    return found.group(1)


def test_the_quickstart_runs_as_written_on_two_cpu_devices(runner):
    script = runner.tmp_path / "train.py"
    script.write_text(quickstart())
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", str(script), timeout=150)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "multigpu: 2 devices (CPU:0, CPU:1), shares 50%/50% (128 + 128 rows of each batch of 256)" in res.stdout
    assert res.stdout.count("Epoch 2/2") == 1, res.stdout[-3000:]  # Keras's progress, from rank 0 only
    assert (runner.tmp_path / "model.keras").is_file() and res.stdout.count("final loss") == 1
    assert runner.leftovers() == []


def test_the_tutorial_runs_as_written_on_two_unequal_devices(runner):
    """docs/tutorial.md's script under the command it gives: the shares follow the devices' speeds, the report
    and the final lines come from rank 0."""
    text = (README.parent / "docs" / "tutorial.md").read_text()
    found = re.search(r"<!-- tutorial -->\n```python\n(.*?)```\n<!-- /tutorial -->", text, re.S)
    assert found and "multigpu run --devices cpu:0 cpu:1@0.5 train.py" in text
    script = runner.tmp_path / "train.py"
    script.write_text(found.group(1))
    res = runner.cli("run", "--devices", "cpu:0", "cpu:1@0.5", "train.py", timeout=150)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "multigpu: 2 devices (CPU:0, CPU:1@0.5)" in res.stdout and res.stdout.count("Epoch 4/4") == 1
    assert res.stdout.count("multigpu: where the time went in epoch 4:") == 1, res.stdout[-3000:]
    shares = re.search(r"^multigpu: 2 device\(s\): CPU:0 (\d+)%, CPU:1@0.5 (\d+)%$", res.stdout, re.M)
    assert shares and int(shares[1]) > int(shares[2]), res.stdout[-3000:]  # the faster device takes more rows
    accuracy = re.search(r"^accuracy (\d\.\d+)$", res.stdout, re.M)
    assert accuracy and float(accuracy[1]) > 0.3, res.stdout[-3000:]  # ten classes: chance is 0.1
    assert runner.leftovers() == []


def test_the_readme_stays_short_and_points_to_the_documentation():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for needed in ("pip install .", "multigpu.parallelize(model)", "multigpu.rank()", "make docs",
                   "CONTRIBUTING.md"):
        assert needed in text, needed


@pytest.mark.timeout(900)
def test_pip_install_and_the_quickstart_in_a_fresh_environment(runner):
    """What a new user does: a fresh virtual environment, a CPU torch, ``pip install`` of the checkout (not
    editable), and the quickstart copied as written, run with ``python train.py`` and with the installed
    ``multigpu run``, without ``KERAS_BACKEND`` in the environment."""
    import subprocess
    import sys

    venv = runner.tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=600, capture_output=True)
    subprocess.run([*pip, str(README.parent)], check=True, timeout=600, capture_output=True)
    script = runner.tmp_path / "train.py"
    script.write_text(quickstart())
    # As a new user types it: no KERAS_BACKEND, no keras.json of an earlier Keras (Keras's default is TensorFlow,
    # which this environment does not have); `python train.py` takes the machine's devices: two CPU devices here.
    fresh = {"KERAS_BACKEND": None, "KERAS_HOME": str(runner.tmp_path / "keras-home")}
    for args in ([str(venv / "bin" / "python"), "train.py"],
                 [str(venv / "bin" / "multigpu"), "run", "--devices", "cpu:0", "cpu:1", "train.py"]):
        res = runner.run(args, 150, extra_env=fresh)
        assert res.returncode == 0, (args, res.stdout[-3000:])
        assert "multigpu: 2 devices (CPU:0, CPU:1)" in res.stdout, (args, res.stdout[-3000:])
        assert res.stdout.count("final loss") == 1 and res.stdout.rstrip().splitlines()[-1].startswith("final loss")
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import multigpu; print(multigpu.__file__)"],
                           capture_output=True, text=True, check=True, cwd=runner.tmp_path).stdout
    assert where.startswith(str(venv)), where  # the installed copy, not the checkout
    assert runner.leftovers() == []
