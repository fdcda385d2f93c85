"""One benchmark configuration: trains on synthetic data and writes a JSON result.

Started by the benchmark drivers (e.g. ``bench_core.py``), one configuration
per process, never by hand in normal use::

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/_worker.py \\
        --prefix /tmp/r --cores 0 --devices cpu:0 --batch 256 --steps 20

Without ``--devices`` it runs plain Keras ``model.fit`` (no multigpu), bound
to ``--cores`` with one torch thread per core.  With ``--devices`` the model
goes through ``multigpu.parallelize``; each rank (rank 0 re-runs this command
line for the others) writes ``PREFIX.rank<R>.json`` with its steady-state
throughput (global samples/s, first ``--warmup`` steps excluded) and its peak
resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # pragma: no cover


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", required=True, help="result path prefix; writes PREFIX.rank<R>.json")
    p.add_argument("--cores", required=True, help="comma-separated CPU cores this process may use")
    p.add_argument("--devices", default=None, help="multigpu devices, e.g. cpu:0,cpu:1 (default: plain)")
    p.add_argument("--model", choices=("convnet", "mlp"), default="convnet")
    p.add_argument("--width", type=float, default=1.0, help="convnet filter width factor")
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (>= 1)")
    a = p.parse_args()

    # Bind before torch starts its thread pool; multigpu re-binds each rank
    # to its own share of these cores.
    cores = {int(c) for c in a.cores.split(",")}
    os.sched_setaffinity(0, cores)
    import keras
    import numpy as np
    import torch

    from benchmarks.models import convnet, mlp

    torch.set_num_threads(len(cores))
    keras.utils.set_random_seed(1)
    model = convnet(a.width) if a.model == "convnet" else mlp()
    rank = 0
    if a.devices:
        import multigpu

        model = multigpu.parallelize(model, devices=a.devices.split(","))
        rank = multigpu.rank()
    model.compile(optimizer=keras.optimizers.RMSprop(), loss="categorical_crossentropy")

    rows = a.batch * (a.warmup + a.steps)
    rng = np.random.default_rng(0)
    x = rng.random((rows, *model.input_shape[1:]), dtype=np.float32)
    y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, rows)]

    class Timer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.ends: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())

    timer = Timer()
    model.fit(x, y, batch_size=a.batch, epochs=1, verbose=0, callbacks=[timer])
    first = max(1, a.warmup) - 1
    timed, cpu = timer.ends[first:], timer.cpu[first:]
    step_s = (timed[-1] - timed[0]) / (len(timed) - 1)
    result = {
        "rank": rank,
        "world_size": len(a.devices.split(",")) if a.devices else 1,
        "devices": a.devices,
        "cores": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "batch": a.batch,
        "timed_steps": len(timed) - 1,
        "step_s": step_s,
        "step_ms": [round((b - e) * 1e3, 2) for e, b in zip(timer.ends, timer.ends[1:])],
        "samples_per_s": a.batch / step_s,
        "cpu_per_wall": (cpu[-1] - cpu[0]) / (timed[-1] - timed[0]),
        "peak_rss_mb": peak_rss_mb(),
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    with open(f"{a.prefix}.rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
