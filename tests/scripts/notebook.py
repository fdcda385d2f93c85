"""Runs notebooks in a real Jupyter kernel (nbclient + ipykernel), as a user's notebook server would.

    python notebook.py exact OUT.json [--backend jax]   # launch at 3:1 against one device in the kernel
    python notebook.py fail OUT.json                    # a rank raises; then a second launch in the same kernel
    python notebook.py interrupt OUT.json               # the stop button during fit
    python notebook.py kill OUT.json                    # the kernel killed during fit (a restart, a crash)
    python notebook.py example OUT.json                 # examples/notebook.ipynb, quick

Writes what the cells printed and raised, and the checks' numbers, to OUT.json.  The kernel
inherits this process's environment (so the tests find every process it starts).
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError

REPO = Path(__file__).resolve().parents[2]

SETUP = """
import os
os.environ["KERAS_BACKEND"] = {backend!r}
import numpy as np
import keras
import multigpu

def build():
    {seed}
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])

rng = np.random.default_rng(0)
x = rng.normal(size=(203, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 1).astype("int64")

def train(epochs):
    model = multigpu.parallelize(build())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=1)
    return {{"weights": np.concatenate([w.ravel() for w in model.get_weights()]), "history": history.history,
             "rank": multigpu.rank()}}
"""

ONE_DEVICE = """
plain = build()
plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
one = np.concatenate([w.ravel() for w in plain.get_weights()])
"""

LAUNCH = """
got = multigpu.launch(train, 2, devices=["cpu:0", "cpu:1"], ratios=[3, 1])
error = float(np.abs(got["weights"] - one).max() / np.abs(one).max())
print("relative error", error, "rank", got["rank"])
"""

FAIL = """
def broken():
    model = multigpu.parallelize(build())
    if multigpu.rank() == 1:
        raise ValueError("rank one gives up")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=64, epochs=50, verbose=0)

multigpu.launch(broken, devices=["cpu:0", "cpu:1"])
"""

AGAIN = """
again = multigpu.launch(train, 1, devices=["cpu:0", "cpu:1"])
print("second launch rank", again["rank"], "epochs", len(again["history"]["loss"]))
"""

PARALLELIZE = """
multigpu.parallelize(build(), devices=["cpu:0", "cpu:1"])
"""

LONG = """
def forever():
    model = multigpu.parallelize(build())
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    print("training", flush=True)
    model.fit(np.repeat(x, 50, axis=0), np.repeat(y, 50), batch_size=16, epochs=1000, verbose=0)

multigpu.launch(forever, devices=["cpu:0", "cpu:1"])
"""


def notebook(*sources: str):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


def outputs(cell) -> dict:
    text, errors = "", []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            text += out.text
        elif out.output_type == "error":
            errors.append({"ename": out.ename, "evalue": out.evalue})
        elif "text/plain" in out.get("data", {}):
            text += out.data["text/plain"]
    return {"text": text, "errors": errors}


def run_cells(nb, client: NotebookClient, interrupt_after: float | None = None, kill: bool = False) -> list[dict]:
    """Executes the cells one by one; with ``interrupt_after``, interrupts the last cell that many seconds in
    (``kill``: kills the kernel then)."""
    results = []
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            started = time.monotonic()
            if interrupt_after is not None and index == len(nb.cells) - 1:
                import threading

                # As Jupyter's stop button does (jupyter_client's LocalProvisioner): SIGINT to the kernel's
                # process group, which holds the ranks the kernel started too.
                pid = client.km.provisioner.process.pid
                if kill:  # the kernel alone dies, as when it crashes or a restart kills it
                    threading.Timer(interrupt_after, os.kill, args=(pid, signal.SIGKILL)).start()
                else:
                    threading.Timer(interrupt_after, os.killpg, args=(os.getpgid(pid), signal.SIGINT)).start()
            try:
                client.execute_cell(cell, index)
            except CellExecutionError:
                pass
            except DeadKernelError as exc:
                results.append({"text": "", "errors": [{"ename": "DeadKernelError", "evalue": str(exc)}],
                                "seconds": time.monotonic() - started})
                return results
            results.append({**outputs(cell), "seconds": time.monotonic() - started})
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["exact", "fail", "interrupt", "kill", "example"])
    p.add_argument("out")
    p.add_argument("--backend", default="torch")
    a = p.parse_args()
    os.environ["KERAS_BACKEND"] = a.backend
    kw = {"kernel_name": "python3", "timeout": 240, "allow_errors": True, "resources": {"metadata": {
        "path": str(Path(a.out).resolve().parent)}}}
    # seeded where a result is compared with one device's (Keras's set_random_seed imports TensorFlow wherever it
    # is installed: 2 s of every process that calls it); a rank's error needs no seed
    seed = "pass" if a.mode == "fail" else "keras.utils.set_random_seed(2)"
    setup = SETUP.format(backend=a.backend, seed=seed)
    if a.mode == "exact":
        nb = notebook(setup, ONE_DEVICE, LAUNCH)
        result = run_cells(nb, NotebookClient(nb, **kw))
    elif a.mode == "fail":
        nb = notebook(setup, PARALLELIZE, FAIL, AGAIN)
        result = run_cells(nb, NotebookClient(nb, **kw))
    elif a.mode in ("interrupt", "kill"):
        nb = notebook(setup, LONG)
        result = run_cells(nb, NotebookClient(nb, **kw), interrupt_after=8.0, kill=a.mode == "kill")
    else:
        os.environ["MULTIGPU_NOTEBOOK_QUICK"] = "1"
        kw["resources"]["metadata"]["path"] = str(REPO / "examples")  # as Jupyter runs it: in the examples' folder
        nb = nbformat.read(REPO / "examples" / "notebook.ipynb", as_version=4)
        result = run_cells(nb, NotebookClient(nb, **kw))
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
