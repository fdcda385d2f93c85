"""Trains a small model with Dense, Conv2D, GRU, Embedding and an L2
regulariser, once per optimizer, and writes the final weights and History to an .npz file.

    python exactness.py OUT.npz --devices cpu:0,cpu:1 --ratios 3,1 --optimizers sgd,adam
    python exactness.py OUT.npz --plain        # no multigpu at all

Used by the tests to compare N devices with one.
"""

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed


def build(seed: int) -> keras.Model:
    set_random_seed(seed)
    image = keras.Input((8, 8, 1), name="image")
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    a = keras.layers.Conv2D(4, 3, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))(image)
    a = keras.layers.Flatten()(a)
    b = keras.layers.Embedding(20, 5)(tokens)
    b = keras.layers.GRU(6)(b)
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Dense(16, activation="tanh")(h)
    out = keras.layers.Dense(3, activation="softmax")(h)
    return keras.Model([image, tokens], out)


def data(rows: int):
    rng = np.random.default_rng(0)
    x1 = rng.normal(size=(rows, 8, 8, 1)).astype("float32")
    x2 = rng.integers(0, 20, size=(rows, 6)).astype("int32")
    y = rng.integers(0, 3, size=(rows,))
    return [x1, x2], y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", default="cpu:0")
    p.add_argument("--ratios", default=None)
    p.add_argument("--optimizers", default="sgd,adam")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--compression", default=None, choices=["bf16", "fp16"])
    a = p.parse_args()
    arrays, rank = {}, 0
    for name in a.optimizers.split(","):
        model = build(1)
        if not a.plain:
            import multigpu

            ratios = [float(r) for r in a.ratios.split(",")] if a.ratios else None
            model = multigpu.parallelize(model, devices=a.devices.split(","), ratios=ratios,
                                         compression=a.compression)
            rank = multigpu.rank()
        opt = keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        x, y = data(a.rows)
        hist = model.fit(x, y, batch_size=a.batch, epochs=a.epochs, shuffle=False, verbose=0)
        for i, w in enumerate(model.get_weights()):
            arrays[f"{name}.w{i}"] = w
        arrays[f"{name}.history"] = json.dumps(hist.history)
        if not a.plain:
            arrays[f"{name}.overlap"] = multigpu.state(model).overlap
    np.savez(a.out if rank == 0 else f"{a.out}.rank{rank}.npz", **arrays)


if __name__ == "__main__":
    main()
