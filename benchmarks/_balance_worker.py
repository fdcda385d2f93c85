"""One configuration of the balance benchmark: trains on synthetic data, writes JSON.

Started by ``bench_balance.py``, one configuration per process, never by hand
in normal use::

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/_balance_worker.py \\
        --prefix /tmp/r --cores 0,1 --devices cpu:0,cpu:1@0.5 --ratios auto --batch 256 --steps 12

The model goes through ``multigpu.parallelize(model, devices=..., ratios=...)``
(one device for the solo runs); rank 0 re-runs this command line for the
other ranks.  Each rank writes ``PREFIX.rank<R>.json`` with the wall-clock end
of every training step (``time.perf_counter``, taken in
``on_train_batch_end``), its CPU time and every core's busy time
(``/proc/stat``, to see other processes' load) at the same points, and the
shares in force after every step (``model._multigpu_state.ratios``).

Rank 0 prints ``bench-step N`` after step N, so that the ``multigpu: ...``
lines multigpu prints during a step can be attributed to that step.

``--slowdown-step S`` makes the run a mid-run slowdown: rank ``--slow-rank``
puts itself under a ``CpuQuota(--quota-start, cores)`` right after
``parallelize`` and changes it to ``--slowdown-fraction`` at the end of step S.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def cpu_busy_seconds() -> list[float]:
    """Per CPU, seconds spent busy (by anyone) or stolen since boot, from /proc/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, line.split()[1:9])
                out.append((user + nice + system + irq + softirq + steal) / tick)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", required=True, help="result path prefix; writes PREFIX.rank<R>.json")
    p.add_argument("--cores", required=True, help="comma-separated CPU cores the run may use")
    p.add_argument("--devices", required=True, help="multigpu devices, e.g. cpu:0,cpu:1@0.5")
    p.add_argument("--ratios", default=None, help="'auto' or comma-separated ratios (default: multigpu's)")
    p.add_argument("--rebalance", choices=("on", "off", "default"), default="default",
                   help="parallelize(rebalance=True/False/None)")
    p.add_argument("--profile", default=None, help="profile path for ratios='auto' (recalibrates)")
    p.add_argument("--width", type=float, default=1.0, help="convnet filter width factor")
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--steps", type=int, required=True, help="training steps to run (one epoch)")
    p.add_argument("--slowdown-step", type=int, default=None,
                   help="after this step, --slow-rank's CPU quota drops to --slowdown-fraction")
    p.add_argument("--slow-rank", type=int, default=1, help="the rank that slows down")
    p.add_argument("--quota-start", type=float, default=1.0, help="the slow rank's CPU quota at start")
    p.add_argument("--slowdown-fraction", type=float, default=0.5, help="its quota after the slowdown")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    # Bind before torch starts its thread pool; multigpu re-binds each rank
    # to its own core among these.
    os.sched_setaffinity(0, {int(c) for c in a.cores.split(",")})
    import keras
    import numpy as np
    import torch

    import multigpu
    from benchmarks.models import convnet
    from multigpu.throttle import CpuQuota

    keras.utils.set_random_seed(1)
    model = convnet(a.width)
    kwargs: dict[str, Any] = {}
    if a.ratios == "auto":
        kwargs["ratios"] = "auto"
    elif a.ratios:
        kwargs["ratios"] = [float(r) for r in a.ratios.split(",")]
    if a.rebalance != "default":
        kwargs["rebalance"] = a.rebalance == "on"
    if a.profile:
        kwargs["profile"] = a.profile
        kwargs["recalibrate"] = True
    model = multigpu.parallelize(model, devices=a.devices.split(","), **kwargs)
    rank = multigpu.rank()
    state = model._multigpu_state

    quota: CpuQuota | None = None
    if a.slowdown_step is not None and rank == a.slow_rank:
        quota = CpuQuota(a.quota_start, len(os.sched_getaffinity(0)))
        quota.apply()
    model.compile(optimizer=keras.optimizers.RMSprop(), loss="categorical_crossentropy")

    rows = a.batch * a.steps
    rng = np.random.default_rng(0)
    x = rng.random((rows, *model.input_shape[1:]), dtype=np.float32)
    y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, rows)]

    class Recorder(keras.callbacks.Callback):
        """Per step: wall and CPU time at its end, the shares after it; the slowdown."""

        def __init__(self) -> None:
            super().__init__()
            self.ends: list[float] = []
            self.cpu: list[float] = []
            self.busy: list[list[float]] = []
            self.shares: list[list[float]] = []
            self.slowdown_at: float | None = None

        def on_train_begin(self, logs=None):
            self.begin = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())
            self.busy.append(cpu_busy_seconds())
            total = sum(state.ratios)
            self.shares.append([r / total for r in state.ratios])
            step = len(self.ends)
            if quota is not None and step == a.slowdown_step:
                quota.set_fraction(a.slowdown_fraction)
                self.slowdown_at = time.perf_counter()
            if rank == 0:
                print(f"bench-step {step}", flush=True)

    recorder = Recorder()
    model.fit(x, y, batch_size=a.batch, epochs=1, verbose=0, shuffle=False, callbacks=[recorder])
    result = {
        "rank": rank,
        "world_size": multigpu.world_size(),
        "devices": a.devices,
        "ratios_arg": a.ratios,
        "rebalance_arg": a.rebalance,
        "cores": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "batch": a.batch,
        "local_batch": state.shares_for(a.batch)[rank],
        "begin": recorder.begin,
        "ends": recorder.ends,
        "cpu": recorder.cpu,
        "busy": recorder.busy,
        "shares": recorder.shares,
        "speeds": state.speeds,
        "rebalance_every": state.rebalance_every if state.rebalancer is not None else None,
        "rebalance_changes": state.rebalancer.changes if state.rebalancer is not None else 0,
        "slowdown_step": a.slowdown_step,
        "slowdown_at": recorder.slowdown_at,
        "quota_fraction": quota.fraction if quota is not None else state.runtime.device.speed,
    }
    with open(f"{a.prefix}.rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
