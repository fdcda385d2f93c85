"""A model whose training state a small device cannot hold whole: the check before the first step, and the
weights in parts.

    python state_fits.py DEVICES LEVEL OUT

LEVEL is ``whole`` (``shard_optimizer=False``), ``optimizer``, ``gradients``, ``weights`` (``shard=LEVEL``) or
``one`` (one device, DEVICES not used: the reference).  Eight dense layers of 1024 x 1024 and Adam: 32 MiB of
trainable weights in 4 MiB layers.  At equal parts (a device of unknown size beside) the first step adds
96 MiB on a device at ``whole`` (gradients and both moments), 64 MiB at ``optimizer``, 32 MiB at ``gradients``
(the moments of its half) and about 20 MiB at ``weights`` (the moments of its half and one layer gathered, less
the half of the weights it lets go).  Rank 0 writes the epochs' losses to OUT.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed

import multigpu

devices, level, out = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
rng = np.random.default_rng(0)
x = rng.standard_normal((256, 1024)).astype(np.float32)
y = rng.integers(0, 10, 256)
set_random_seed(0)
model = keras.Sequential([keras.Input((1024,)),
                          *[keras.layers.Dense(1024, activation="relu") for _ in range(8)], keras.layers.Dense(10)])
if level != "one":
    chosen = {"shard_optimizer": False} if level == "whole" else {"shard": level}
    model = multigpu.parallelize(model, devices=devices, ratios=[1, 1], **chosen)
model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
if multigpu.rank() == 0:
    with open(out, "w") as f:
        json.dump({"loss": history.history["loss"]}, f)
