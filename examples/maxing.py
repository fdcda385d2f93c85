"""Load every device fully: find the ratios for this machine's devices, report samples/s.

    KERAS_BACKEND=torch python examples/maxing.py                           # ratios measured (auto)
    KERAS_BACKEND=torch python examples/maxing.py --quick                   # about a minute on 2 CPU cores
    KERAS_BACKEND=torch python examples/maxing.py --devices cpu:0,cpu:1@0.5 --recalibrate
    KERAS_BACKEND=torch python examples/maxing.py --ratios 2,1              # given ratios, no measuring

The model (``build_model`` below) is a convnet with far more layers than it needs, so that every
device has plenty to do, trained on synthetic 32x32x3 images.  With ``--ratios auto`` (the default here) each device
times a few solo steps at the first training step and the shares follow the measured
speeds; the result is kept in a profile (``--profile``, default
``~/.cache/multigpu/profiles.json``) so the next run starts balanced without measuring, and
``--recalibrate`` measures again.  While training the shares move toward the measured
compute speeds.  The script prints what calibration found
(``multigpu.state(model).ratios`` and ``.speeds``), a where-the-time-went table per epoch
(``parallelize(..., report=True)``) and samples/s per device and in total.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from _common import add_device_arguments, apply_quick_defaults, shares_text, table_row

import multigpu

CLASSES = 10


# ------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_arguments(p, ratios_default="auto",
                         ratios_help="'auto' (default here: measure, or reuse the profile) or numbers such as 3,1")
    p.add_argument("--recalibrate", action="store_true", help="measure again even if the profile has an entry")
    p.add_argument("--profile", default=None, help="profile JSON (default ~/.cache/multigpu/profiles.json)")
    p.add_argument("--no-report", action="store_true", help="no where-the-time-went table per epoch")
    p.add_argument("--width", type=float, default=None, help="filter-count scale (default 1.0 = 64; 0.25 with --quick)")
    p.add_argument("--depth", type=int, default=None, help="convolutions (default 12; 6 with --quick)")
    p.add_argument("--rows", type=int, default=None, help="synthetic 32x32x3 images (default 4096; 3072 with --quick)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 256; 128 with --quick)")
    p.add_argument("--epochs", type=int, default=None, help="default 2 (1 with --quick)")
    p.add_argument("--quick", action="store_true", help="a small model and few rows: about a minute on CPU")
    a = p.parse_args(argv)
    apply_quick_defaults(a, {"width": (1.0, 0.25), "depth": (12, 6), "rows": (4096, 3072), "batch_size": (256, 128),
                             "epochs": (2, 1)})
    if min(a.depth, a.rows, a.batch_size, a.epochs) < 1 or a.width <= 0:
        p.error("--depth, --rows, --batch-size and --epochs must be positive, --width above 0")
    return a


# ---------------------------------------------------------------- model, data
def build_model(width: float = 1.0, depth: int = 12) -> keras.Model:
    """``depth`` convolutions of 64 filters (at width 1) on 32x32x3 images, pooled, and a softmax."""
    layers: list = [keras.Input((32, 32, 3))]
    for _ in range(depth):
        layers.append(keras.layers.Conv2D(max(1, round(64 * width)), 3, padding="same", activation="relu"))
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(CLASSES, activation="softmax")]
    return keras.Sequential(layers, name="maxing")


def make_data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random images and a learnable label: which of ``CLASSES`` equal slices of the pixels has the largest sum."""
    x = np.random.default_rng(seed).normal(size=(rows, 32, 32, 3)).astype("float32")
    flat = x.reshape(rows, -1)
    usable = flat[:, : flat.shape[1] - flat.shape[1] % CLASSES]
    return x, usable.reshape(rows, CLASSES, -1).sum(axis=2).argmax(axis=1).astype("int64")


# ------------------------------------------------------------------ callbacks
class AfterFirstStep(keras.callbacks.Callback):
    """Keeps the ratios and speeds as they are after the first step (where calibration happens)."""

    def __init__(self) -> None:
        super().__init__()
        self.ratios: list[float] | None = None
        self.speeds: list[float] | None = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.ratios is None:
            state = multigpu.state(self.model)
            self.ratios = [float(r) for r in state.ratios]
            self.speeds = None if state.speeds is None else [float(s) for s in state.speeds]


class Throughput(keras.callbacks.Callback):
    """Samples/s of each epoch, leaving out its first step (warm-up and calibration)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.rates: list[float] = []
        self._steps = 0
        self._start: float | None = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._steps, self._start = 0, None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._start is None:
            self._start = time.perf_counter()
        else:
            self._steps += 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._steps and self._start is not None:
            self.rates.append(self._steps * self.batch_size / (time.perf_counter() - self._start))


# ----------------------------------------------------------------------- main
def main() -> None:
    args = parse_args()
    keras.utils.set_random_seed(0)
    model = build_model(args.width, depth=args.depth)
    model = multigpu.parallelize(model, devices=args.devices, ratios=args.ratios, recalibrate=args.recalibrate,
                                 profile=args.profile, report=not args.no_report)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = make_data(args.rows)
    state = multigpu.state(model)
    devices = state.devices
    if multigpu.rank() == 0:
        print(f"maxing: {args.depth} convolutions of {max(1, round(64 * args.width))} filters, "
              f"{model.count_params():,} parameters; {args.rows} rows, global batch {args.batch_size}; "
              f"devices {', '.join(d.label for d in devices)}; ratios {args.ratios}", flush=True)
    first, meter = AfterFirstStep(), Throughput(args.batch_size)
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, callbacks=[first, meter], verbose=2)
    if multigpu.rank() != 0:
        return
    print()
    if first.speeds:
        found = ", ".join(f"{d.label} {s:.1f} samples/s" for d, s in zip(devices, first.speeds))
        print(f"calibration found: {found} -> ratios {[round(r, 3) for r in first.ratios]} "
              f"(shares {shares_text(first.ratios)})")
    else:
        print(f"no calibration (given or equal ratios): ratios {first.ratios} (shares {shares_text(first.ratios)})")
    if state.ratios != first.ratios:
        print(f"after training (rebalanced): ratios {[round(r, 3) for r in state.ratios]} "
              f"(shares {shares_text(state.ratios)})")
    rate = meter.rates[-1] if meter.rates else float("nan")
    shares = state.shares(args.batch_size)
    widths = (12, 8, 8, 12)
    print("\n" + table_row(["device", "share", "batch", "samples/s"], widths))
    for dev, ratio, rows in zip(devices, state.ratios, shares):
        print(table_row([dev.label, f"{ratio / sum(state.ratios):.0%}", rows, f"{rate * rows / args.batch_size:.1f}"],
                        widths))
    print(table_row(["total", "100%", args.batch_size, f"{rate:.1f}"], widths))


if __name__ == "__main__":
    main()
