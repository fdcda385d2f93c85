"""Trains an MLP on devices of different speeds with automatic ratios.

    python balance.py OUT.json --devices cpu:0,cpu:1@0.5 [--profile P] [--epochs N]

Writes the final ratios, the measured speeds and the last per-device report.
"""

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed

import multigpu


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", default="cpu:0,cpu:1@0.5")
    p.add_argument("--profile", default=None)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--rows", type=int, default=6144)
    p.add_argument("--ratios", default=None)
    a = p.parse_args()
    set_random_seed(0)
    model = keras.Sequential([keras.Input((128,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    ratios = None if a.ratios is None else a.ratios
    model = multigpu.parallelize(model, devices=a.devices.split(","), ratios=ratios, profile=a.profile,
                                 report=True, timeout=30)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(a.rows, 128)).astype("float32")
    y = rng.integers(0, 10, size=(a.rows,))
    model.fit(x, y, batch_size=256, epochs=a.epochs, verbose=0)
    state = multigpu.state(model)
    if multigpu.rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"ratios": state.ratios, "speeds": state.speeds, "report": state.last_report}, f)


if __name__ == "__main__":
    main()
