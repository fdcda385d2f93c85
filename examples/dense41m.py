"""A 41-million-parameter dense network: it pays off on several devices when the batch grows with them.

    KERAS_BACKEND=torch python examples/dense41m.py                     # the full model, batch 64 per device
    KERAS_BACKEND=torch python examples/dense41m.py --quick             # a narrow copy: about a minute on CPU
    KERAS_BACKEND=torch python examples/dense41m.py --devices cpu:0,cpu:1@0.5 --ratios 2,1

The model (``build_model`` below) is Dense(4000, tanh) on 8000 inputs, Dense(2000, relu),
Dense(500, relu), Dense(300, relu), Dense(1, sigmoid), trained with binary cross-entropy and
Adam on random data (``--width`` shrinks the hidden layers).  Every step
all-reduces 41 million gradients, so a small batch split over N devices mostly waits on
communication; a batch that grows with N keeps every device's share as large as the single
device's batch.  The script runs, each in its own processes (``parallelize`` happens once
per process, so it runs itself with a hidden ``--worker`` flag):

* 1 device at batch b,
* N devices at batch b (the same global batch, split), and
* N devices at batch N*b (scaled),

and prints samples/s and the speedup over one device for each.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from _common import PlannedDevice, add_device_arguments, apply_quick_defaults, plan_devices, run_worker, table_row

import multigpu


# ------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_arguments(p)
    p.add_argument("--batch-size", type=int, default=None, help="b: the one-device batch (default 64; 32 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20; 10 with --quick)")
    p.add_argument("--warmup", type=int, default=2, help="steps not timed at the start of each run")
    p.add_argument("--width", type=float, default=None,
                   help="hidden-layer scale (default 1.0 = 41M parameters; 0.05 with --quick)")
    p.add_argument("--quick", action="store_true", help="a narrow model and few steps: about a minute on CPU")
    p.add_argument("--worker", default=None, metavar="RESULT_JSON", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    apply_quick_defaults(a, {"batch_size": (64, 32), "steps": (20, 10), "width": (1.0, 0.05)})
    if a.batch_size < 1 or a.steps < 2 or a.warmup < 0 or a.width <= 0:
        p.error("--batch-size must be positive, --steps at least 2, --warmup at least 0, --width above 0")
    return a


# ---------------------------------------------------------------- model, data
def build_model(width: float = 1.0) -> keras.Model:
    """Dense(4000, tanh) on 8000 inputs, 2000, 500, 300, 1 (about 41M parameters; ``width`` scales the hidden
    layers)."""
    def units(n: int) -> int:
        return max(1, round(n * width))

    return keras.Sequential([
        keras.Input((8000,)),
        keras.layers.Dense(units(4000), activation="tanh"),
        keras.layers.Dense(units(2000), activation="relu"),
        keras.layers.Dense(units(500), activation="relu"),
        keras.layers.Dense(units(300), activation="relu"),
        keras.layers.Dense(1, activation="sigmoid"),
    ], name="dense41m")


def make_data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs and a learnable label: whether the first input is positive."""
    x = np.random.default_rng(seed).normal(size=(rows, 8000)).astype("float32")
    return x, (x[:, 0] > 0).astype("float32")[:, None]


# --------------------------------------------------------------------- worker
class StepClock(keras.callbacks.Callback):
    """End time of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[float] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.ends.append(time.perf_counter())


def worker(args: argparse.Namespace) -> None:
    """Trains ``warmup + steps`` steps at global batch ``args.batch_size``; rank 0 writes samples/s."""
    keras.utils.set_random_seed(0)
    model = build_model(args.width)
    model = multigpu.parallelize(model, devices=args.devices, ratios=args.ratios)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    x, y = make_data(args.batch_size * (args.warmup + args.steps))
    clock = StepClock()
    hist = model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, callbacks=[clock], verbose=0)
    if multigpu.rank() == 0:
        timed = clock.ends[args.warmup:] if len(clock.ends) > args.warmup + 1 else clock.ends
        rate = args.batch_size * (len(timed) - 1) / (timed[-1] - timed[0])
        Path(args.worker).write_text(json.dumps({
            "devices": multigpu.world_size(), "batch_size": args.batch_size,
            "shares": multigpu.state(model).shares(args.batch_size), "samples_per_second": rate,
            "parameters": model.count_params(), "loss": float(hist.history["loss"][-1]),
        }))


# --------------------------------------------------------------------- driver
def run_configuration(args: argparse.Namespace, devices: list[PlannedDevice], ratios: str | list[float] | None,
                      batch_size: int) -> dict:
    """One configuration in fresh processes (the worker starts its other ranks itself)."""
    options = ["--batch-size", str(batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--width", str(args.width)]
    return run_worker(__file__, devices, options, ratios=ratios, prefix="dense41m-")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    devices = plan_devices(args.devices)
    n, b = len(devices), args.batch_size
    if n < 2:
        print("dense41m needs at least two devices to compare; it found "
              f"{', '.join(d.spec for d in devices)}.", flush=True)
    configs = [("1 device", devices[:1], None, b)]
    if n > 1:
        configs += [(f"{n} devices, same batch", devices, args.ratios, b),
                    (f"{n} devices, batch x{n}", devices, args.ratios, n * b)]
    print(f"dense41m at width {args.width} on {', '.join(d.spec for d in devices)}: {args.steps} timed steps "
          f"per run after {args.warmup} warm-up steps", flush=True)
    results = []
    for name, devs, ratios, batch in configs:
        result = run_configuration(args, devs, ratios, batch)
        result["name"] = name
        results.append(result)
        print(f"{name}: global batch {batch} {result['shares']}, {result['samples_per_second']:.1f} samples/s",
              flush=True)
    base = results[0]["samples_per_second"]
    print(f"\n{results[0]['parameters']:,} parameters")
    widths = (26, 14, 14, 12, 10)
    print(table_row(["run", "global batch", "per device", "samples/s", "speed up"], widths))
    for r in results:
        per_device = "/".join(str(s) for s in r["shares"])
        print(table_row([r["name"], r["batch_size"], per_device, f"{r['samples_per_second']:.1f}",
                         f"{r['samples_per_second'] / base:.2f}x"], widths))
    if n > 1:
        print(f"\nscaled batch: {results[2]['samples_per_second'] / base:.2f}x the samples/s of one device "
              f"on {n} devices ({results[2]['samples_per_second'] / base / n:.0%} scaling efficiency); "
              f"same batch: {results[1]['samples_per_second'] / base:.2f}x")


if __name__ == "__main__":
    main()
