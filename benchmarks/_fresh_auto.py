"""One run of ``bench_fresh_auto.py``: an outside model trained as a user would, in a plain script.

    python benchmarks/_fresh_auto.py OUT.json --profile NEW.json --ratios auto|2,1|equal [--model convnet ...]
    python benchmarks/_fresh_auto.py OUT.json --profile NEW.json --model wide --no-rebalance   # calibrated, kept

``python script.py`` with ``devices=["cpu:0", "cpu:1@0.5"]``: the script re-runs itself once per
device.  Rank 0 writes the end time of every training step, per epoch, and the shares at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import keras
import numpy as np
from outside_model import BUILDERS, INPUTS

import multigpu


class StepEnds(keras.callbacks.Callback):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def on_train_begin(self, logs=None):
        self.epochs: list[list[float]] = []
        self.shares: list[list[int]] = []  # the shares each step planned the next one with

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append([time.perf_counter()])

    def on_train_batch_end(self, batch, logs=None):
        self.epochs[-1].append(time.perf_counter())
        self.shares.append(multigpu.state(self.model).shares(self.batch))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ratios", default="auto")
    p.add_argument("--devices", default="cpu:0,cpu:1@0.5")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--model", default="convnet", choices=sorted(BUILDERS))
    p.add_argument("--profile", required=True, help="a profile file that does not exist yet (a fresh profile)")
    p.add_argument("--no-rebalance", action="store_true",
                   help="with --ratios auto: calibrate, then keep the calibrated shares (rebalance=False)")
    a = p.parse_args()
    if a.ratios in ("auto", "equal"):
        ratios = "auto" if a.ratios == "auto" else [1, 1]
    else:
        ratios = [float(v) for v in a.ratios.split(",")]
    keras.utils.set_random_seed(0)
    extra = {"rebalance": False} if a.no_rebalance else {}
    model = multigpu.parallelize(BUILDERS[a.model](), devices=a.devices.split(","), ratios=ratios, profile=a.profile,
                                 **extra)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.batch * a.steps, *INPUTS[a.model])).astype("float32")
    y = rng.integers(0, 10, a.batch * a.steps)
    ends = StepEnds(a.batch)
    model.fit(x, y, batch_size=a.batch, epochs=a.epochs, shuffle=False, verbose=0, callbacks=[ends])
    if multigpu.rank() == 0:
        last = ends.epochs[-1]
        Path(a.out).write_text(json.dumps({
            "ratios": a.ratios, "batch": a.batch, "steps": [list(np.diff(e)) for e in ends.epochs],
            "samples_per_second": a.batch * (len(last) - 1) / (last[-1] - last[0]),
            "epochs_samples_per_second": [a.batch * (len(e) - 1) / (e[-1] - e[0]) for e in ends.epochs],
            "shares": multigpu.state(model).shares(a.batch), "shares_by_step": ends.shares}))


if __name__ == "__main__":
    main()
