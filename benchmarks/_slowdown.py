"""One rank of the mid-run slowdown run of ``bench_balance.py`` (started by ``multigpu run``).

    multigpu run --devices cpu:0,cpu:1 --ratios auto benchmarks/_slowdown.py OUT.json \
        --model convnet --width 0.25 --batch 256 --steps 90 --slow-after 30

Rank 1 puts itself under a CPU quota of 1.0 and drops it to ``--fraction`` at the end of step
``--slow-after``; rank 0 writes each step's end time and the shares after it to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras

import multigpu
from multigpu.bench.models import get_model
from multigpu.throttle import CpuQuota


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="convnet")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--slow-after", type=int, default=30)
    p.add_argument("--fraction", type=float, default=0.5)
    a = p.parse_args()
    keras.utils.set_random_seed(0)
    spec = get_model(a.model)
    model = multigpu.parallelize(spec.build(a.width), profile=a.out + ".profile.json", recalibrate=True)
    spec.compile(model)
    quota = None
    if multigpu.rank() == 1:
        quota = CpuQuota(1.0, len(os.sched_getaffinity(0)))
        quota.apply()
    ends, shares = [], []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())
            shares.append(list(multigpu.state(model).shares(a.batch)))  # a snapshot: read it anew
            if quota is not None and len(ends) == a.slow_after:
                quota.set_fraction(a.fraction)

    x, y = spec.data(a.batch * a.steps, 0)
    model.fit(x, y, batch_size=a.batch, epochs=1, shuffle=False, verbose=0, callbacks=[Record()])
    if multigpu.rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"ends": ends, "shares": shares, "batch": a.batch, "slow_after": a.slow_after}, f)


if __name__ == "__main__":
    main()
