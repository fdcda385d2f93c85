"""What a Keras 3 user on TensorFlow gets today for two CPU devices: ``tf.distribute.MirroredStrategy``.

Keras 3 has no multi-process path on TensorFlow (its ``distribution_lib`` for
TensorFlow is marked a prototype; ``MultiWorkerMirroredStrategy`` is not
supported, keras-team/keras#20585), so the one built-in way to use two devices
is ``MirroredStrategy`` over two logical CPU devices in one process, equal
halves of every batch.  This runs the benchmark convnet (32x32x3, batch 128,
SGD) with Keras ``fit`` on the TensorFlow backend:

* ``single``: one process pinned to one core, no strategy;
* ``mirrored``: one process on both cores, two logical CPU devices under
  ``MirroredStrategy``;

and prints samples/s and their ratio, or that the run hung or failed (then
that is what the user gets).  Usage::

    .venv/bin/python benchmarks/bench_tf_mirrored.py --out benchmarks/tensorflow/tf-mirrored.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 128


def _model(keras, width: float):
    f = [max(4, int(c * width)) for c in (32, 32, 64, 64)]
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(f[0], 3, padding="same", activation="relu"),
        keras.layers.Conv2D(f[1], 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(f[2], 3, padding="same", activation="relu"),
        keras.layers.Conv2D(f[3], 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10, activation="softmax"),
    ])


def worker(a) -> None:
    import numpy as np
    import tensorflow as tf

    if a.config == "single":
        os.sched_setaffinity(0, {0})
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras

    steps = a.warmup + a.steps
    rng = np.random.default_rng(0)
    x = rng.random((steps * BATCH, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, steps * BATCH)
    marks = {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            marks[step] = time.perf_counter()

    if a.config == "single":
        model = _model(keras, a.width)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    else:
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model = _model(keras, a.width)
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[Clock()])
    seconds = marks[steps - 1] - marks[a.warmup - 1]
    Path(a.result).write_text(json.dumps({"samples_per_second": a.steps * BATCH / seconds}))


def run(config: str, a) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker", "--config", config, "--result", str(result),
               "--steps", str(a.steps), "--warmup", str(a.warmup), "--width", str(a.width)]
        try:
            res = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"hung: no result within {a.timeout:g} s"}
        if res.returncode or not result.exists():
            return {"error": f"failed (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}"}
        return json.loads(result.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "tensorflow" / "tf-mirrored.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    rounds = []
    for r in range(a.rounds):
        got = {config: run(config, a) for config in ("single", "mirrored")}
        rounds.append(got)
        print(f"round {r + 1}: " + ", ".join(
            f"{c} {g['samples_per_second']:.0f} samples/s" if "samples_per_second" in g else f"{c} {g['error']}"
            for c, g in got.items()), flush=True)
    done = [g for g in rounds if all("samples_per_second" in v for v in g.values())]
    if done:
        ratios = [g["mirrored"]["samples_per_second"] / g["single"]["samples_per_second"] for g in done]
        print(f"MirroredStrategy on two CPU devices / one device: {', '.join(f'{r:.2f}x' for r in ratios)}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rounds": rounds, "batch": BATCH, "width": a.width}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
