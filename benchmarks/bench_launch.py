"""What ``multigpu.launch`` costs over ``multigpu run``: start-up and steady samples/s of the same training.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_launch.py        # ~4 min
    ... benchmarks/bench_launch.py --ways run,srun,mpirun   # SLURM (SLURM_CONF of a running slurmd) and Open MPI

The same training (the convnet of ``_input_worker.py`` at width 2 on in-memory images, global
batch 128, ``cpu:0`` and ``cpu:1``, equal shares) three ways, in ``--rounds`` rounds:

* ``run``: ``multigpu run --devices cpu:0,cpu:1 SCRIPT`` from a shell;
* ``launch``: ``multigpu.launch(train)`` from a Python process that has imported Keras and
  computed with it first, as a notebook kernel has;
* ``notebook``: ``multigpu.launch(train)`` in a cell of a real Jupyter kernel (nbclient), with
  ``train`` defined in the notebook (so it travels pickled by value);
* ``srun``: ``srun -n 2 python SCRIPT`` (a SLURM with a running ``slurmd``: ``SLURM_CONF`` names
  its configuration), each task one rank on ``cpu:LOCAL_RANK``;
* ``mpirun``: ``mpirun -np 2 python SCRIPT`` (Open MPI), the same.

Start-up is the time from the command (or the call) to the end of the first training step;
samples/s is measured after ``--warmup`` steps.  Prints the medians and writes
``benchmarks/launch/launch.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TRAIN = '''
def train(steps, warmup, out=None):
    import json, time
    import keras
    import multigpu
    from _input_worker import BATCH, build, images
    keras.utils.set_random_seed(1)
    model = multigpu.parallelize(build(2.0))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    x, y = images()
    n = (steps + warmup) * BATCH
    marks = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            marks.append(time.time())

    index = [i % len(x) for i in range(n)]
    model.fit(x[index], y[index], batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[Clock()])
    result = {"first_step_at": marks[0], "samples_per_second": steps * BATCH / (marks[-1] - marks[warmup - 1])}
    if out and multigpu.rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    return result
'''

SCRIPT = TRAIN + '''
if __name__ == "__main__":
    import sys
    train(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
'''

LAUNCHER = TRAIN + '''
import json, sys, time
import keras, numpy as np
keras.ops.sum(keras.ops.ones((4, 4)))  # the caller has computed with Keras, as a kernel has
import multigpu
start = time.time()
result = multigpu.launch(train, int(sys.argv[1]), int(sys.argv[2]), devices=["cpu:0", "cpu:1"], ratios=[1, 1])
result["start"] = start
with open(sys.argv[3], "w") as f:
    json.dump(result, f)
'''


# The command lines that start the script on two devices, each ahead of the script and its arguments.
LAUNCHED = {
    "run": [sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1", "--ratios", "1,1"],
    "srun": ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable],
    "mpirun": ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
               *(["--allow-run-as-root"] if os.geteuid() == 0 else []), sys.executable],
}


def _env() -> dict:
    return dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND") or "torch", OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}")


def one_run(way: str, steps: int, warmup: int, folder: Path) -> dict:
    out = folder / f"{way}.json"
    out.unlink(missing_ok=True)
    if way in LAUNCHED:
        script = folder / "train_script.py"
        script.write_text(SCRIPT)
        start = time.time()
        subprocess.run([*LAUNCHED[way], str(script), str(steps), str(warmup), str(out)], env=_env(), check=True,
                       cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        result = json.loads(out.read_text())
        result["start"] = start
    elif way == "launch":
        script = folder / "launcher.py"
        script.write_text(LAUNCHER)
        subprocess.run([sys.executable, str(script), str(steps), str(warmup), str(out)], env=_env(), check=True,
                       cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        result = json.loads(out.read_text())
    else:
        result = _notebook(steps, warmup, out)
    result["startup"] = result["first_step_at"] - result["start"]
    return result


def _notebook(steps: int, warmup: int, out: Path) -> dict:
    import nbformat
    from nbclient import NotebookClient

    env = _env()
    os.environ.update({k: env[k] for k in ("KERAS_BACKEND", "OMP_NUM_THREADS", "PYTHONWARNINGS", "PYTHONPATH")})
    cells = [TRAIN + "\nimport keras\nkeras.ops.sum(keras.ops.ones((4, 4)))\nimport multigpu, time, json",
             f"start = time.time()\nresult = multigpu.launch(train, {steps}, {warmup}, devices=['cpu:0', 'cpu:1'], "
             f"ratios=[1, 1])\nresult['start'] = start\njson.dump(result, open({str(out)!r}, 'w'))"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": str(out.parent)}}).execute()
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ways", default="run,launch,notebook", help="comma-separated, of run, launch, notebook, srun, "
                   "mpirun (run is the baseline and always runs)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "launch" / "launch.json"))
    a = p.parse_args()
    ways = ["run", *[w for w in a.ways.split(",") if w != "run"]]
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory(prefix="multigpu-bench-launch-") as tmp:
        for round_ in range(a.rounds):
            for way in ways:
                r = one_run(way, a.steps, a.warmup, Path(tmp))
                runs[way].append(r)
                print(f"  round {round_ + 1} {way:9s} start-up {r['startup']:5.2f} s, "
                      f"{r['samples_per_second']:7.0f} samples/s", flush=True)
    summary = {w: {"startup": statistics.median(r["startup"] for r in rs),
                   "samples_per_second": statistics.median(r["samples_per_second"] for r in rs),
                   "rounds": rs} for w, rs in runs.items()}
    base = summary["run"]
    print("\n| way | start-up (s) | more than run (s) | samples/s | / run |")
    print("|---|---:|---:|---:|---:|")
    for w, s in summary.items():
        print(f"| {w} | {s['startup']:.2f} | {s['startup'] - base['startup']:+.2f} | {s['samples_per_second']:.0f} | "
              f"{s['samples_per_second'] / base['samples_per_second']:.2f}x |")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "cpus": os.cpu_count(),
            "command": " ".join(["benchmarks/bench_launch.py", *sys.argv[1:]])}
    Path(a.out).write_text(json.dumps({"meta": meta, "results": summary}, indent=1))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
