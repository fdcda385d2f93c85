"""The training script of bench_host.py: a user's script that loads its features at the top.

    python _script.py DIR MODE DEVICES   (MODE: plain, mmap, load_once or load_once_fn; DEVICES: cpu:0,cpu:1)
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

import multigpu

folder, mode, devices = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
x_path, y_path = os.path.join(folder, "x.npy"), os.path.join(folder, "y.npy")
if mode == "plain":
    x, y = np.load(x_path), np.load(y_path)
elif mode == "mmap":
    x, y = np.load(x_path, mmap_mode="r"), np.load(y_path, mmap_mode="r")
elif mode == "load_once":  # np.load of a path: read straight into shared memory
    x, y = multigpu.load_once(np.load, x_path), multigpu.load_once(np.load, y_path)
elif mode == "load_once_fn":  # a function of the user's: its arrays copied into shared memory
    x, y = multigpu.load_once(lambda: (np.load(x_path), np.load(y_path)))
else:
    raise SystemExit(f"unknown mode {mode!r}: plain, mmap, load_once or load_once_fn")

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10)])
model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
if len(devices) > 1:
    model = multigpu.parallelize(model, devices=devices, ratios=[1] * len(devices))
model.fit(x, y, batch_size=2048, epochs=1, verbose=0)
