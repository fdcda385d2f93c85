"""A fast device with little memory beside a slow one with plenty: automatic shares at batch B, then 2B.

    python memory_caps.py DEVICES RATIOS OUT [--batch B] [--gpu-mib M] [--model mlp|convnet]

``--gpu-mib M`` holds a GPU rank's torch allocator to M MiB (``torch.cuda.set_per_process_memory_fraction``):
a real CUDA out-of-memory error. ``--model convnet`` trains a small convnet (28x28x1 images, two
convolutions) instead of the MLP with wide activations.

The last rank (not bounded) trains one device on the same batches and writes the largest difference of the
weights, relative to their scale, to OUT.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed

import multigpu

devices, ratios, out = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
flags = dict(zip(sys.argv[4::2], sys.argv[5::2]))
batch = int(flags.get("--batch", 256))
gpu_mib = float(flags["--gpu-mib"]) if "--gpu-mib" in flags else None
convnet = flags.get("--model", "mlp") == "convnet"
rng = np.random.default_rng(0)
rows = 4 * batch if convnet else max(8192, 4 * batch)
x = rng.standard_normal((rows, 28, 28, 1) if convnet else (rows, 64)).astype(np.float32)
y = rng.integers(0, 10, rows)


def build():
    set_random_seed(0)
    if convnet:  # activations of 28x28x32 and 14x14x64 a row: a step's memory is mostly its rows'
        layers = [keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                  keras.layers.MaxPooling2D(),
                  keras.layers.Conv2D(64, 3, padding="same", activation="relu"), keras.layers.GlobalAveragePooling2D(),
                  keras.layers.Dense(10)]
    else:  # wide activations over few weights: a step's memory is mostly its rows'
        layers = [keras.Input((64,)), keras.layers.Dense(8192, activation="tanh"), keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


model = build()
# The same first weights on every rank and processor (a GPU's random numbers are not a CPU's).
initial = [np.random.default_rng(1).standard_normal(w.shape).astype(np.float32) * 0.05 for w in model.get_weights()]
model.set_weights(initial)
# The optimizer state whole on every rank: these runs measure what a step's rows take beside a fixed state (a
# state in parts, smaller, leaves the out-of-memory steps' lowered caps below the measured one, which is then
# not said); the state in parts is measured in benchmarks/optimizer_sharding/.
model = multigpu.parallelize(model, devices=devices, ratios="auto" if ratios == "auto" else
                             [float(v) for v in ratios.split(":")], shard_optimizer=False)
if gpu_mib is not None and os.environ.get("KERAS_TORCH_DEVICE", "").startswith("cuda"):
    import torch

    torch.cuda.set_per_process_memory_fraction(gpu_mib * 2**20 / torch.cuda.get_device_properties(0).total_memory)
model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
model.fit(x, y, batch_size=2 * batch, epochs=2, shuffle=False, verbose=0)
if multigpu.rank() == multigpu.world_size() - 1:
    reference = build()
    reference.set_weights(initial)
    reference.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=2 * batch, epochs=2, shuffle=False, verbose=0)
    error = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
                for a, b in zip(model.get_weights(), reference.get_weights()))
    with open(out, "w") as f:
        json.dump({"error": error}, f)
