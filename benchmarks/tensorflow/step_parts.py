"""Where a TensorFlow rank's kept step goes: the MLP (width 0.5, SGD) at batch 64 on ``cpu:0`` and ``cpu:1``, equal
shares, each rank timing its parts after a short ``fit``.

    KERAS_BACKEND=tensorflow OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tensorflow/step_parts.py [RUNS]

Each run prints, per rank (milliseconds a step, medians of 100 steps): ``before`` the step's sum (the local
forward and backward pass and the hand-over to the ``numpy_function``), ``sum`` (the engine's sum, its wait
for the other rank included), ``after`` (the update and the metric results), the whole fused ``step``, the
same step without the sum (``alone``: what the rank left runs while the other is set aside) and the minor page
faults the rank took a step.  ``GLIBC_TUNABLES= `` before the command runs the ranks with glibc's own malloc
thresholds (``multigpu.runtime.processes.keep_freed_memory`` leaves a process alone whose environment sets
them).
"""

import json
import os
import subprocess
import sys
import time

STEPS = 100


def rank() -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import multigpu
    from multigpu.bench.models import mlp
    from multigpu.keras.parallel import _MODELS

    model = multigpu.parallelize(mlp(0.5), devices=["cpu:0", "cpu:1"], ratios=[1, 1])
    model.compile(optimizer=keras.optimizers.SGD(), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = rng.random((64 * 50, 784), dtype=np.float32)
    y = rng.integers(0, 10, 64 * 50)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    steps = _MODELS[model].steps
    fn = steps._train
    xb, yb, w, tail = tf.constant(x[:32]), tf.constant(y[:32]), tf.constant(0.5), tf.constant(steps._message())
    marks = []
    reduce = steps.comm.reduce_parts

    def timed_reduce(parts, what="summing gradients"):
        began = time.perf_counter()
        out = reduce(parts, what)
        marks.append((began, time.perf_counter()))
        return out

    steps.comm.reduce_parts = timed_reduce

    def faults() -> int:
        return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])

    fn.step(xb, yb, None, w, tail)[1].numpy()
    before, spans = faults(), []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        fn.step(xb, yb, None, w, tail)[1].numpy()
        t3 = time.perf_counter()
        t1, t2 = marks[-1]
        spans.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    flt = (faults() - before) / STEPS
    fn.alone(xb, yb, None, w, tail)[1].numpy()
    alone = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        fn.alone(xb, yb, None, w, tail)[1].numpy()
        alone.append(time.perf_counter() - t0)
    parts = np.median(np.array(spans), axis=0) * 1000
    print("RESULT " + json.dumps({"rank": multigpu.rank(), **{k: round(float(v), 2) for k, v in zip(
        ("before", "sum", "after", "step"), parts)}, "alone": round(float(np.median(alone)) * 1000, 2),
        "faults": flt}), flush=True)


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
           "STEP_PARTS_RANK": "1"}
    print("milliseconds a step (medians of 100): before the sum, the sum, after it, the step; the step without "
          "the sum; page faults a step")
    for run in range(runs):
        res = subprocess.run([sys.executable, __file__], check=False, env=env, capture_output=True, text=True,
                             timeout=600)
        found = sorted((json.loads(line[7:]) for line in res.stdout.splitlines() if line.startswith("RESULT ")),
                       key=lambda r: r["rank"])
        if not found:
            print(res.stdout[-2000:] + res.stderr[-2000:])
            return 1
        print(f"run {run + 1}: " + " | ".join(
            f"rank {r['rank']}: {r['before']} + {r['sum']} + {r['after']} = {r['step']}, alone {r['alone']}, "
            f"{r['faults']:.0f} faults" for r in found), flush=True)
    return 0


if __name__ == "__main__":
    if os.environ.get("STEP_PARTS_RANK"):
        rank()
    else:
        sys.exit(main())
