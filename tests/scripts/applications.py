"""``keras.applications`` models (``weights=None``) trained one epoch, compared with one plain process by the tests.

    python applications.py OUT.npz --plain
    multigpu run --devices cpu:0,cpu:1 --ratios 3,1 applications.py OUT.npz

``MobileNetV3Small`` (BatchNormalization, hard-swish, squeeze-and-excitation,
its own rescaling; dropout 0) on 32x32x3 images, 10 classes, 40 rows at
global batch 16 (the last batch of 8), SGD, ``sync_batchnorm=True``.
(``EfficientNetB0``'s stochastic depth draws its own random numbers per
device, so no run of it is exact; it and ``ResNet50`` are benchmark cases.)
Writes the weights and
History (rank R > 0: OUT.rankR.npz).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

ROWS, BATCH = 40, 16


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    rng = np.random.default_rng(2)
    x = rng.uniform(0, 255, size=(ROWS, 32, 32, 3)).astype("float32")
    y = (x[:, :16].mean(axis=(1, 2, 3)) > x[:, 16:].mean(axis=(1, 2, 3))).astype("int64")
    rank, results = 0, {}
    for name in ("MobileNetV3Small",):
        keras.utils.set_random_seed(4)
        model = keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), classes=10,
                                                    dropout_rate=0.0)
        if not a.plain:
            import multigpu

            model = multigpu.parallelize(model, sync_batchnorm=True, timeout=90)
            rank = multigpu.rank()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        results[name] = np.concatenate([w.ravel() for w in model.get_weights()])
        results[f"{name}_history"] = json.dumps(history.history)
    np.savez(a.out if rank == 0 else f"{a.out}.rank{rank}.npz", **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
