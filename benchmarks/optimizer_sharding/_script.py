"""One run of ``bench_sharding.py``: a dense model of about 30M weights trained with Adam, as a plain script.

    python benchmarks/optimizer_sharding/_script.py OUT.json --devices cpu:0,cpu:1 --ratios 1,1 \
        [--shard none|optimizer|gradients|weights]

Two epochs of ``--steps`` steps at global batch ``--batch``; rank 0 writes the second epoch's samples/s and
each rank's peak resident memory (``VmHWM``) to OUT.json (ranks > 0 to OUT.json.rankR).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

import multigpu


def build(width: int, inputs: int) -> keras.Model:
    """inputs -> width -> width -> 1024 -> 10: 29.4M weights at width 4096 and 2048 inputs."""
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1024, activation="relu"),
                             keras.layers.Dense(10)])


class EpochTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times: list[tuple[float, float]] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.began = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append((self.began, time.perf_counter()))


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", default="cpu:0,cpu:1")
    p.add_argument("--ratios", default="1,1")
    p.add_argument("--shard", default="none", choices=["none", "optimizer", "gradients", "weights"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--inputs", type=int, default=2048)
    a = p.parse_args()
    keras.utils.set_random_seed(0)
    model = build(a.width, a.inputs)
    devices = a.devices.split(",")
    if len(devices) > 1:
        model = multigpu.parallelize(model, devices=devices, ratios=[float(r) for r in a.ratios.split(",")],
                                     shard_optimizer=False if a.shard == "none" else None,
                                     shard=None if a.shard == "none" else a.shard)
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.batch * a.steps, a.inputs)).astype("float32")
    y = rng.integers(0, 10, a.batch * a.steps)
    times = EpochTimes()
    model.fit(x, y, batch_size=a.batch, epochs=2, shuffle=False, verbose=0, callbacks=[times])
    began, ended = times.times[-1]
    rank = multigpu.rank()
    out = a.out if rank == 0 else f"{a.out}.rank{rank}"
    with open(out, "w") as f:
        json.dump({"backend": keras.backend.backend(),
                   "samples_per_second": a.batch * a.steps / (ended - began), "peak_rss_mb": peak_rss_mb(),
                   "weights": int(sum(np.prod(v.shape) for v in model.trainable_variables))}, f)


if __name__ == "__main__":
    main()
