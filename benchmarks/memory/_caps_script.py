"""The training script of bench_caps.py: a fast device with little memory beside a slow one with plenty.

    python _caps_script.py DEVICES RATIOS BATCH EPOCHS OUT

Trains at BATCH for 2 epochs (automatic shares settle there), then at 2*BATCH for EPOCHS; rank 0 writes the
samples/s of the second fit's epochs after its first (JSON) to OUT.
"""

import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

import multigpu

devices, ratios, batch, epochs, out = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
    sys.argv[5]
rng = np.random.default_rng(0)
x = rng.standard_normal((8192, 64)).astype(np.float32)
y = rng.integers(0, 10, 8192)
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8192, activation="tanh"), keras.layers.Dense(10)])
model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model = multigpu.parallelize(model, devices=devices, ratios="auto" if ratios == "auto" else
                             [float(v) for v in ratios.split(":")])


class EpochTimes(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.began = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.began)


model.fit(x, y, batch_size=batch, epochs=2, verbose=0)
timer = EpochTimes()
timer.times = []
model.fit(x, y, batch_size=2 * batch, epochs=epochs, verbose=0, callbacks=[timer])
if multigpu.rank() == 0:
    with open(out, "w") as f:
        json.dump({"samples_per_second": len(x) * (epochs - 1) / sum(timer.times[1:]),
                   "shares": multigpu.state(model).ratios}, f)
