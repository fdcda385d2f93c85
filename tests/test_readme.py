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


def test_the_readme_stays_short_and_points_to_the_documentation():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for needed in ("pip install keras-multigpu", "multigpu.parallelize(model)", "multigpu.rank()", "make docs",
                   "CONTRIBUTING.md"):
        assert needed in text, needed
