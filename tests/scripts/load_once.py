"""load_once in a user's script: the data loaded once per machine, shared read-only by every process.

    python load_once.py COUNTER OUT [--devices cpu:0,cpu:1] [--no-fit]

Each call of the loading function appends a line to COUNTER; rank 0 writes what it saw to OUT (JSON).
"""

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np

import multigpu

parser = argparse.ArgumentParser()
parser.add_argument("counter")
parser.add_argument("out")
parser.add_argument("--devices", default="cpu:0,cpu:1")
parser.add_argument("--no-fit", action="store_true")
args = parser.parse_args()


def load(rows):
    with open(args.counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((rows, 4)).astype(np.float32),
            "y": (rng.standard_normal((rows, 1)).astype(np.float32), "a label", 3)}


data = multigpu.load_once(load, rows=96)
first_pid = os.getpid()
if args.no_fit:  # under an outside launcher: no training, just what each process got
    seen = {"rank": multigpu.rank(), "sum": float(data["x"].sum()), "writeable": bool(data["x"].flags.writeable),
            "other": list(data["y"][1:])}
    with open(f"{args.out}.{multigpu.rank()}", "w") as f:
        json.dump(seen, f)
    raise SystemExit(0)

import keras  # noqa: E402
from seeding import set_random_seed  # noqa: E402

set_random_seed(1)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.05), "mse")
initial = model.get_weights()
model = multigpu.parallelize(model, devices=args.devices.split(","), ratios=[3, 1])
model.fit(data["x"], data["y"][0], batch_size=32, epochs=2, shuffle=False, verbose=0)
if multigpu.rank() == 0:
    with open(f"/proc/{os.getppid()}/status") as f:
        supervisor_rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
    reference.compile(keras.optimizers.SGD(0.05), "mse")
    reference.set_weights(initial)
    reference.fit(np.array(data["x"]), np.array(data["y"][0]), batch_size=32, epochs=2, shuffle=False, verbose=0)
    error = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights()))
    with open(args.out, "w") as f:
        json.dump({"supervisor": os.getppid(), "supervisor_rss_kb": supervisor_rss, "error": error,
                   "writeable": bool(data["x"].flags.writeable), "other": list(data["y"][1:])}, f)
