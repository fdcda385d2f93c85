"""What being ready to lose a device costs while none is lost: ``min_devices`` against none.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fault_cost.py     # ~3 min

Two CPU devices at 1:1 (a core each) train a dense network (784 -> ``--width`` -> ``--width`` -> 10,
Adam, global batch 256, 24 steps an epoch, 3 epochs) under ``python`` (multigpu's own supervisor),
once with Keras's step and once with a ``train_step`` of the model's own (``custom_step_model.py``'s,
Keras's torch step written out), each with and without ``min_devices=1``, alternating, ``--rounds``
times.  With ``min_devices`` every rank beats a heartbeat, and keeps what a step's forward pass changes (metric states,
non-trainable variables); a step of the model's own also keeps what its updates change (the weights
and the optimizer's state, copied into buffers kept across steps), since its logs are summed after
its updates and a loss there must put them back.  Samples/s of the fastest epoch after the first;
printed as ratios of the same step's run without ``min_devices`` and written to
``benchmarks/faults/fault_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "faults" / "fault_cost.json"


def worker(step: str, ready: bool, width: int) -> None:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras
    import numpy as np
    from custom_step_model import CustomStep  # this folder's: Keras's guide's torch step, written by hand

    import multigpu

    keras.utils.set_random_seed(0)
    inputs = keras.Input((784,))
    h = keras.layers.Dense(width, activation="relu")(inputs)
    h = keras.layers.Dense(width, activation="relu")(h)
    model = (CustomStep if step == "own" else keras.Model)(inputs, keras.layers.Dense(10)(h))
    model = multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], ratios=[1, 1],
                                 min_devices=1 if ready else None)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256 * 24, 784)).astype("float32")
    y = rng.integers(0, 10, len(x))
    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.began)

    model.fit(x, y, batch_size=256, epochs=3, verbose=0, callbacks=[Clock()])
    if multigpu.state(model).rank == 0:
        print(f"RESULT {len(x) / min(times[1:]):.1f} {model.count_params()}", flush=True)


def run(step: str, ready: bool, width: int) -> tuple[float, int]:
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, __file__, "--worker", step, "--width", str(width), *(["--ready"] if ready else [])]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            rate, params = line.split()[1:]
            return float(rate), int(params)
    raise RuntimeError(f"{' '.join(args)} printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--worker", choices=("keras", "own"))
    p.add_argument("--ready", action="store_true")
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a.ready, a.width)
        return
    rows = {}
    for step in ("keras", "own"):
        rates: dict[bool, list[float]] = {False: [], True: []}
        params = 0
        for _ in range(a.rounds):
            for ready in (False, True):
                rate, params = run(step, ready, a.width)
                rates[ready].append(rate)
        ratios = [r / n for r, n in zip(rates[True], rates[False])]
        rows[step] = {"samples_per_s_without": rates[False], "samples_per_s_with_min_devices": rates[True],
                      "ratios": ratios, "median_ratio": statistics.median(ratios), "params": params}
        print(f"{'Keras step' if step == 'keras' else 'own train_step':>15}: min_devices=1 at "
              f"{statistics.median(ratios):.2f}x without (rounds {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"{statistics.median(rates[True]):,.0f} against {statistics.median(rates[False]):,.0f} samples/s, "
              f"{params:,} parameters, Adam)", flush=True)
    OUT.write_text(json.dumps({"width": a.width, "rounds": a.rounds, "steps": rows, "python": platform.python_version(),
                               "date": time.strftime("%Y-%m-%d")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
