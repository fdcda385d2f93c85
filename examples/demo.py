"""The main demo: a small convnet trained across this machine's devices.

    make demo                      # or: KERAS_BACKEND=torch python examples/demo.py
    python examples/demo.py --devices cpu:0,cpu:1 --ratios 3,1 --epochs 2

On a machine with GPUs it uses them all; on a CPU-only machine, two CPU
devices.  It prints the devices, their shares and samples/s.  The data is
synthetic (MNIST-shaped), so the demo needs no download.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

import multigpu
from multigpu.planning import split


def build_model(width: float) -> keras.Model:
    w = lambda n: max(4, int(n * width))  # noqa: E731
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(w(32), 3, activation="relu"),
        keras.layers.Conv2D(w(64), 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(w(128), activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


class Throughput(keras.callbacks.Callback):
    """Samples/s over each epoch, skipping the first step (warm-up)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.rates: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps, self.start = 0, None

    def on_train_batch_end(self, batch, logs=None):
        if self.start is None:
            self.start = time.perf_counter()
        else:
            self.steps += 1

    def on_epoch_end(self, epoch, logs=None):
        if self.steps:
            self.rates.append(self.steps * self.batch_size / (time.perf_counter() - self.start))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="auto")
    p.add_argument("--ratios", default=None, help="e.g. 3,1 (default: equal)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--width", type=float, default=0.5, help="filter-count scale (1.0 = full)")
    a = p.parse_args()
    keras.utils.set_random_seed(0)
    model = build_model(a.width)
    ratios = [float(r) for r in a.ratios.split(",")] if a.ratios else None
    model = multigpu.parallelize(model, devices=a.devices, ratios=ratios)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(a.rows, 28, 28, 1)).astype("float32")
    y = (x[:, 10:18, 10:18, 0].mean(axis=(1, 2)) * 40).astype("int64").clip(-5, 4) + 5
    meter = Throughput(a.batch_size)
    if multigpu.rank() == 0:
        model.summary()
        print(f"Training {a.epochs} epoch(s) on {a.rows} synthetic MNIST-shaped rows, "
              f"global batch {a.batch_size}, width {a.width}")
    hist = model.fit(x, y, batch_size=a.batch_size, epochs=a.epochs, callbacks=[meter], verbose=2)
    if multigpu.rank() == 0:
        state = model._multigpu_state
        total = sum(state.ratios)
        rate = meter.rates[-1] if meter.rates else float("nan")
        shares = split(a.batch_size, state.ratios)
        print(f"\n{'device':<12}{'share':>8}{'batch':>8}{'samples/s':>12}")
        for dev, r, b in zip(state.runtime.devices, state.ratios, shares):
            print(f"{dev.label:<12}{r / total:>8.0%}{b:>8}{rate * b / a.batch_size:>12.1f}")
        print(f"{'total':<12}{'100%':>8}{a.batch_size:>8}{rate:>12.1f}")
        print(f"final loss {hist.history['loss'][-1]:.4f}, accuracy {hist.history['accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
