"""``multigpu.launch`` in a real Jupyter kernel (nbclient + ipykernel), as a notebook user runs it.

``scripts/notebook.py`` executes notebooks cell by cell in a kernel that
inherits the test's environment, so the leftover check sees every process the
kernel started.
"""

import json
import re

import pytest

pytest.importorskip("nbclient", reason="the notebook tests need nbclient and ipykernel (make test installs them)")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

BACKENDS = {"torch": {}, "jax": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}}


def run_notebook(runner, mode: str, *args: str, extra_env=None, timeout: float = 220) -> list[dict]:
    out = runner.tmp_path / f"{mode}.json"
    res = runner.script("notebook.py", mode, str(out), *args, timeout=timeout, extra_env=extra_env)
    assert res.returncode == 0, res.stdout[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_launch_at_3_to_1_in_a_kernel_reproduces_one_device(runner, backend):
    if backend == "jax":
        pytest.importorskip("jax")
    setup, one, launched = run_notebook(runner, "exact", "--backend", backend, extra_env=BACKENDS[backend])
    assert not setup["errors"] and not one["errors"] and not launched["errors"], launched
    error = float(re.search(r"relative error (\S+) rank 0", launched["text"])[1])
    assert error < 1e-5  # the kernel computed with Keras first (on JAX too); the ranks are fresh processes
    assert "Epoch 2/2" in launched["text"]  # rank 0's progress reached the cell
    assert "[rank 1]" not in launched["text"]  # rank 1 printed nothing of its own
    assert runner.leftovers() == []


def test_a_rank_error_raises_in_the_cell_and_the_kernel_stays_usable(runner):
    _, parallelize, failed, again = run_notebook(runner, "fail")
    [error] = parallelize["errors"]
    assert error["ename"] == "RuntimeError" and "multigpu.launch(train" in error["evalue"]
    [error] = failed["errors"]
    assert error["ename"] == "RankError", error
    assert "rank 1 (CPU:1)" in error["evalue"] and "ValueError: rank one gives up" in error["evalue"]
    assert "Traceback of rank 1" in error["evalue"] and "in broken" in error["evalue"]
    assert failed["seconds"] < 60  # rank 0, training for 50 epochs, was stopped
    assert not again["errors"] and "second launch rank 0 epochs 1" in again["text"]
    assert runner.leftovers() == []


def test_the_stop_button_stops_every_rank_and_raises_keyboard_interrupt(runner):
    *_, long = run_notebook(runner, "interrupt")
    assert [e["ename"] for e in long["errors"]] == ["KeyboardInterrupt"], long
    assert "training" in long["text"]  # the ranks were training when the kernel was interrupted (8 s in)
    assert long["seconds"] < 8 + 10
    assert runner.leftovers() == []


def test_a_killed_kernel_leaves_no_process_behind(runner):
    """A kernel that dies (a restart kills it) takes its ranks, and their loaders' workers, with it."""
    *_, long = run_notebook(runner, "kill")
    assert [e["ename"] for e in long["errors"]] == ["DeadKernelError"], long
    assert runner.leftovers(wait=10.0) == []
