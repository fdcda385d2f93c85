"""A stacked GRU classifier on synthetic sequences: speedup across batch sizes, 1 and N devices.

    KERAS_BACKEND=torch python examples/gru_sequences.py                  # batch sizes 64 to 1024
    KERAS_BACKEND=torch python examples/gru_sequences.py --quick          # about a minute on 2 CPU cores
    KERAS_BACKEND=torch python examples/gru_sequences.py --devices cpu:0,cpu:1@0.5 --ratios auto

For every batch size it trains the same model (``build_model`` below: GRU, GRU, softmax)
on 1 device and on all devices (and 2 in between when there are more than 2), each
configuration in its own process: ``parallelize`` happens once per process, so the script
runs itself with a hidden ``--worker`` flag for each configuration and reads back a JSON
result.  It prints one table row per batch size and device count: accuracy, validation
accuracy, time per epoch and the speedup over one device at the same batch size.  A run on
fewer devices than listed uses the first ones, bound to the CPU cores they have in the
full run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from _common import (
    EpochTimer,
    PlannedDevice,
    add_device_arguments,
    apply_quick_defaults,
    plan_devices,
    run_worker,
    steady_epoch_time,
)

import multigpu

TIMESTEPS, FEATURES, CLASSES = 40, 16, 4


# ------------------------------------------------------------------ arguments
def sizes_arg(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-sizes takes integers such as 64,256. Received: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes must be positive. Received: {text!r}")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_arguments(p)
    p.add_argument("--batch-sizes", type=sizes_arg, default=None,
                   help="global batch sizes (default 64,128,256,512,1024; 64,256 with --quick)")
    p.add_argument("--rows", type=int, default=None,
                   help="sequences, a fifth held out (default 8192; 2048 with --quick)")
    p.add_argument("--epochs", type=int, default=None, help="default 3 (2 with --quick)")
    p.add_argument("--width", type=float, default=None,
                   help="GRU units scale (default 1.0 = 64 units; 0.5 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer, smaller runs: about a minute on CPU")
    p.add_argument("--worker", default=None, metavar="RESULT_JSON", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=None, help=argparse.SUPPRESS)  # the worker's
    a = p.parse_args(argv)
    apply_quick_defaults(a, {"batch_sizes": ([64, 128, 256, 512, 1024], [64, 256]), "rows": (8192, 2048),
                             "epochs": (3, 2), "width": (1.0, 0.5)})
    if a.rows < 10 or a.epochs < 1 or a.width <= 0:
        p.error("--rows must be at least 10, --epochs positive, --width above 0")
    return a


# ---------------------------------------------------------------- model, data
def build_model(width: float = 1.0) -> keras.Model:
    """Two stacked GRUs (64 units at width 1) and a softmax over the classes."""
    units = max(1, round(64 * width))
    return keras.Sequential([
        keras.Input((TIMESTEPS, FEATURES)),
        keras.layers.GRU(units, return_sequences=True),
        keras.layers.GRU(units),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ], name="gru")


def make_sequences(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Noisy sequences whose class is the feature that is raised, weakly, at every step."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=rows)
    x = rng.normal(size=(rows, TIMESTEPS, FEATURES)).astype("float32")
    x[np.arange(rows), :, y] += 0.5
    return x, y.astype("int64")


# --------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """One configuration: trains on ``args.devices`` at ``args.batch_size``; rank 0 writes JSON."""
    keras.utils.set_random_seed(0)
    x, y = make_sequences(args.rows)
    model = build_model(args.width)
    model = multigpu.parallelize(model, devices=args.devices, ratios=args.ratios)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    timer = EpochTimer()
    hist = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, validation_split=0.2,
                     callbacks=[timer], verbose=0)
    if multigpu.rank() == 0:
        Path(args.worker).write_text(json.dumps({
            "batch_size": args.batch_size,
            "devices": multigpu.world_size(),
            "accuracy": float(hist.history["accuracy"][-1]),
            "val_accuracy": float(hist.history["val_accuracy"][-1]),
            "time": steady_epoch_time(timer.seconds),  # the first epoch, warm-up, left out
            "ratios": multigpu.state(model).ratios,
        }))


# --------------------------------------------------------------------- driver
def run_configuration(args: argparse.Namespace, devices: list[PlannedDevice], ratios: str | list[float] | None,
                      batch_size: int) -> dict:
    """One configuration in fresh processes (the worker starts its other ranks itself)."""
    options = ["--batch-size", str(batch_size), "--rows", str(args.rows), "--epochs", str(args.epochs),
               "--width", str(args.width)]
    return run_worker(__file__, devices, options, ratios=ratios, prefix="gru-sequences-")


def device_counts(n: int) -> list[int]:
    return sorted({k for k in (1, 2, n) if k <= n})


def print_table(rows: list[dict]) -> None:
    print("\n| batch size | devices | accuracy | validation accuracy | time (s) | speed up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['devices']} | {r['accuracy']:.3f} | {r['val_accuracy']:.3f} | "
              f"{r['time']:.2f} | {r['speedup']:.2f} |")
    print("(time: seconds per training epoch, leaving out the first epoch when there are several; "
          "speed up: one device's time over this row's, at the same batch size)")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    devices = plan_devices(args.devices)
    counts = device_counts(len(devices))
    print(f"GRU on {args.rows} synthetic sequences of {TIMESTEPS}x{FEATURES}, {args.epochs} epoch(s), "
          f"devices {', '.join(d.spec for d in devices)}; batch sizes {args.batch_sizes}", flush=True)
    rows = []
    for batch_size in args.batch_sizes:
        base = None
        for k in counts:
            ratios = args.ratios[:k] if isinstance(args.ratios, list) else args.ratios
            if k == 1:
                ratios = None
            result = run_configuration(args, devices[:k], ratios, batch_size)
            base = result["time"] if k == 1 else base
            result["speedup"] = base / result["time"] if base else float("nan")
            rows.append(result)
            print(f"batch {batch_size:>5}, {k} device(s): accuracy {result['accuracy']:.3f}, "
                  f"validation accuracy {result['val_accuracy']:.3f}, {result['time']:.2f} s/epoch, "
                  f"speed up {result['speedup']:.2f}", flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
