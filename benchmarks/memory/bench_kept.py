"""What a torch process keeps after steps at a larger batch: its private memory (``VmData``, what ``RLIMIT_DATA``
counts, and so what a CPU device given a size is capped by) after one epoch at each batch size in turn.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_kept.py plain       # plain Keras
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_kept.py multigpu    # parallelize on cpu:0
    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_kept.py plain

The model is ``bench_caps.py``'s (64 -> 8192 tanh -> 10, about 95 KiB a row). Prints ``(batch, MiB)`` pairs.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np


def private_mib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData"):
                return int(line.split()[1]) // 1024
    return -1


def main(mode: str) -> None:
    if mode not in ("plain", "multigpu"):
        raise SystemExit(f"bench_kept.py takes 'plain' or 'multigpu'. Received: {mode!r}")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 64)).astype(np.float32)
    y = rng.integers(0, 10, 4096)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8192, activation="tanh"),
                              keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if mode == "multigpu":
        import multigpu

        model = multigpu.parallelize(model, devices=["cpu:0"], ratios=[1])
    seen = []
    for batch in (100, 200, 300, 400, 200, 100):
        model.fit(x[: batch * 6], y[: batch * 6], batch_size=batch, epochs=1, verbose=0)
        seen.append((batch, private_mib()))
    print(mode, seen, flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plain")
