"""The convnet on Fashion-MNIST: one device against all of this machine's devices.

    KERAS_BACKEND=torch python examples/mnist_convnet.py                       # every device vs the first
    KERAS_BACKEND=torch python examples/mnist_convnet.py --quick               # about a minute on 2 CPU cores
    KERAS_BACKEND=torch python examples/mnist_convnet.py --devices cpu:0,cpu:1@0.5 --ratios 2,1

It is the convnet of Keras's old multi-GPU MNIST example (``build_model`` below; ``--width``
scales its filter counts), trained on Fashion-MNIST as installed by Debian's
``dataset-fashion-mnist`` package (or in Keras's cache), read by the few lines of
``read_fashion_mnist``; without the files it says so and trains on synthetic data of the same
shape.

One process can parallelize only once, so the script first trains on the first device alone
by running itself in a subprocess (``--devices FIRST --result-json PATH``, bound to that
device's CPU cores), then trains on all devices through ``multigpu.parallelize`` and prints
time per epoch, test accuracy and the speedup of both runs.
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
    FASHION_MNIST,
    EpochTimer,
    PlannedDevice,
    add_device_arguments,
    apply_quick_defaults,
    plan_devices,
    read_fashion_mnist,
    run_worker,
    shares_text,
    steady_epoch_time,
    table_row,
)

import multigpu

CLASSES = 10


# ------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_arguments(p)
    p.add_argument("--width", type=float, default=None, help="filter-count scale (default 1.0; 0.125 with --quick)")
    p.add_argument("--epochs", type=int, default=None, help="default 3 (2 with --quick)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch")
    p.add_argument("--train-rows", type=int, default=None, help="training rows to use (default all; 2048 with --quick)")
    p.add_argument("--test-rows", type=int, default=None, help="test rows to use (default all; 1000 with --quick)")
    p.add_argument("--synthetic", action="store_true", help="use synthetic data even if Fashion-MNIST is installed")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-device run")
    p.add_argument("--quick", action="store_true", help="a narrow model on a small subset: about a minute on CPU")
    p.add_argument("--result-json", default=None, help=argparse.SUPPRESS)  # the one-device run's worker mode
    a = p.parse_args(argv)
    apply_quick_defaults(a, {"width": (1.0, 0.125), "epochs": (3, 2), "train_rows": (None, 2048),
                             "test_rows": (None, 1000)})
    if a.epochs < 1 or a.batch_size < 1 or a.width <= 0:
        p.error("--epochs and --batch-size must be positive, --width above 0")
    return a


# ---------------------------------------------------------------------- model
def build_model(width: float = 1.0) -> keras.Model:
    """The convnet of Keras's multi-GPU MNIST example; ``width`` scales its filter counts."""
    def filters(n: int) -> int:
        return max(1, round(n * width))

    layers = keras.layers
    inputs = keras.Input((28, 28, 1))
    h = layers.Conv2D(filters(32), 3, activation="relu")(inputs)
    h = layers.Conv2D(filters(256), 3, activation="relu")(h)
    h = layers.BatchNormalization()(h)
    h = layers.Conv2D(filters(128), 3, activation="relu")(h)
    h = layers.MaxPooling2D(2)(h)
    h = layers.Dropout(0.25)(h)
    h = layers.Flatten()(h)
    h = layers.Dense(128, activation="relu")(h)
    h = layers.Dropout(0.5)(h)
    outputs = layers.Dense(CLASSES, activation="softmax")(h)
    return keras.Model(inputs, outputs, name="convnet")


# ----------------------------------------------------------------------- data
def synthetic_data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Images in [0, 1] and one-hot labels: which of ten equal slices of the first 780 pixels has the largest sum."""
    x = np.random.default_rng(seed).normal(size=(rows, 28, 28, 1)).astype("float32")
    labels = x.reshape(rows, -1)[:, :780].reshape(rows, CLASSES, -1).sum(axis=2).argmax(axis=1)
    return 1 / (1 + np.exp(-x)), np.eye(CLASSES, dtype="float32")[labels]  # squashed into [0, 1] like pixels


def load_data(args: argparse.Namespace) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], str]:
    """Train and test arrays: images in [0, 1] of shape (N, 28, 28, 1), one-hot labels."""
    source = "Fashion-MNIST"
    found = None if args.synthetic else read_fashion_mnist()
    if found is None:
        if multigpu.rank() == 0:
            why = ("synthetic data requested (--synthetic)" if args.synthetic else
                   f"no IDX files in {' or '.join(FASHION_MNIST)}: apt-get install dataset-fashion-mnist")
            print(f"Fashion-MNIST not used ({why}); falling back to synthetic data.", flush=True)
        return synthetic_data(args.train_rows or 6000, 0), synthetic_data(args.test_rows or 1000, 1), "synthetic"
    (x_train, y_train), (x_test, y_test) = found

    def prepare(images: np.ndarray, labels: np.ndarray, rows: int | None) -> tuple[np.ndarray, np.ndarray]:
        images, labels = images[:rows], labels[:rows]
        x = (images.astype("float32") / 255.0).reshape(-1, 28, 28, 1)
        y = keras.utils.to_categorical(labels, CLASSES).astype("float32")
        return x, y

    return prepare(x_train, y_train, args.train_rows), prepare(x_test, y_test, args.test_rows), source


# ------------------------------------------------------------------- training
def train(args: argparse.Namespace) -> dict:
    """Trains on ``args.devices`` and returns rank 0's result (every rank trains)."""
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test), source = load_data(args)
    model = build_model(args.width)
    model = multigpu.parallelize(model, devices=args.devices, ratios=args.ratios)
    model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    state = multigpu.state(model)
    timer = EpochTimer()
    if multigpu.rank() == 0:
        print(f"{multigpu.world_size()} device(s): {', '.join(d.label for d in state.devices)}; "
              f"{len(x_train)} {source} training rows, width {args.width}, global batch {args.batch_size}",
              flush=True)
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, callbacks=[timer], verbose=2)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    return {
        "devices": [d.label for d in state.devices],
        "ratios": [float(r) for r in state.ratios],
        "epoch_seconds": timer.seconds,
        "time_per_epoch": steady_epoch_time(timer.seconds),
        "test_loss": float(loss),
        "test_accuracy": float(accuracy),
        "data": source,
    }


# ------------------------------------------------------------ one-device run
def launched_by_another_tool() -> bool:
    """True under ``multigpu run``, ``torchrun``, ``srun`` or ``mpirun``: every rank is already started."""
    return multigpu.world_size() > 1


def run_in_subprocess(args: argparse.Namespace, devices: list[PlannedDevice]) -> dict:
    """This script on ``devices``, in fresh processes bound to those devices' cores."""
    options = ["--width", str(args.width), "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    for flag, value in (("--train-rows", args.train_rows), ("--test-rows", args.test_rows)):
        if value is not None:
            options += [flag, str(value)]
    if args.synthetic:
        options.append("--synthetic")
    return run_worker(__file__, devices, options, ratios=args.ratios, result_flag="--result-json",
                      prefix="mnist-convnet-")


def print_comparison(one: dict | None, many: dict) -> None:
    widths = (28, 16, 15, 10)
    print("\n" + table_row(["run", "time/epoch (s)", "test accuracy", "speed up"], widths))
    rows = [("one device: " + one["devices"][0], one)] if one else []
    rows.append((f"{len(many['devices'])} devices: " + ",".join(many["devices"]), many))
    for name, result in rows:
        speedup = f"{one['time_per_epoch'] / result['time_per_epoch']:.2f}x" if one else "-"
        print(table_row([name, f"{result['time_per_epoch']:.2f}", f"{result['test_accuracy']:.3f}", speedup], widths))
    if one:
        print(f"speedup: {one['time_per_epoch'] / many['time_per_epoch']:.2f}x with {len(many['devices'])} devices "
              f"(shares {shares_text(many['ratios'])})")
    print("(time per epoch leaves out the first epoch, which includes warm-up, when there are several)")


def main() -> None:
    args = parse_args()
    if args.result_json:  # the one-device run, started by the main run below
        result = train(args)
        if multigpu.rank() == 0:
            Path(args.result_json).write_text(json.dumps(result))
        return
    devices = plan_devices(args.devices)
    if args.no_baseline or len(devices) < 2 or launched_by_another_tool():
        if len(devices) < 2:
            print("Only one device: nothing to compare against.", flush=True)
        elif launched_by_another_tool() and multigpu.rank() == 0:
            print("Started by `multigpu run` or torchrun: skipping the one-device run.", flush=True)
        many = train(args)
        if multigpu.rank() == 0:
            print_comparison(None, many)
        return
    # Both runs in fresh processes, one after the other, so that nothing else runs while each is timed.
    print(f"== one device ({devices[0].spec}) ==", flush=True)
    one = run_in_subprocess(args, devices[:1])
    print(f"\n== all {len(devices)} devices ==", flush=True)
    many = run_in_subprocess(args, devices)
    print_comparison(one, many)

if __name__ == "__main__":
    main()
