"""The JAX backend's targets (issue 13), every configuration in fresh processes, one after another.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_jax.py            # ~10 min
    ... benchmarks/bench_jax.py --rounds 2 --width 0.25 --batch 256

All on ``KERAS_BACKEND=jax``, the convnet of ``multigpu bench`` at ``--width`` (0.25: XLA's CPU
convolutions take 4.3 s per step of 64 rows at full width on one core of this machine, 0.25 keeps a
step near 2 s), global batch ``--batch``:

* ``single``: plain Keras ``fit`` on one core;
* ``mg1``: the same through ``multigpu.parallelize`` on ``cpu:0``;
* ``mg2``: multigpu on ``cpu:0`` and ``cpu:1``, equal shares;
* ``keras-dp``: Keras's own ``keras.distribution.DataParallel``, one process on both cores split
  into two XLA host devices, equal shares;
* ``mg2-slow-equal``: multigpu on ``cpu:0`` and ``cpu:1@0.5`` (a cgroup quota of half a core),
  equal shares: what any equal-split tool, Keras's ``DataParallel`` included, does on such devices;
* ``mg2-slow-auto``: the same devices, automatic shares; its first ``--auto-warmup`` steps
  (default 30: calibration, the search's first moves and their compilations, ~6 s each) are
  not timed;
* ``mg2-syncbn``, ``mg2-slow-auto-syncbn``: ``mg2`` and ``mg2-slow-auto`` with ``sync_batchnorm=True``
  (the convnet's BatchNormalization layer normalises with the global batch's statistics): what the
  exchange of statistics through the coordination service costs, and whether automatic shares still
  find the fast device's share when every step waits inside its forward pass;
* ``keras-dp-slow``: Keras's ``DataParallel`` on both cores with 1.5 cores' worth of CPU time (the
  same capacity as a full core beside a half one; a quota cannot slow one XLA host device alone);
* ``keras-dp-procs``, ``keras-dp-procs-slow``: Keras's ``DataParallel`` over two processes (one device
  each, as on several hosts), each feeding its half of every global batch, on ``cpu:0`` + ``cpu:1``
  and on ``cpu:0`` + ``cpu:1@0.5``: Keras's own equal split on a really slower device.

Prints the targets' ratios (medians over ``--rounds``) and writes ``benchmarks/jax/jax.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["KERAS_BACKEND"] = "jax"

from multigpu.bench.runs import run_config  # noqa: E402

CONFIGS = {
    "single": {"mode": "single", "devices": ["cpu:0"], "cores": [0]},
    "mg1": {"mode": "solo", "devices": ["cpu:0"], "cores": [0]},
    "mg2": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1]},
    "keras-dp": {"mode": "keras-dp", "devices": ["cpu:0", "cpu:1"], "cores": [0, 1]},
    "mg2-slow-equal": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1@0.5"], "ratios": [1, 1]},
    "mg2-slow-auto": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1@0.5"], "ratios": "auto", "warmup": 30},
    "mg2-syncbn": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "sync_batchnorm": True},
    "mg2-slow-auto-syncbn": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1@0.5"], "ratios": "auto", "warmup": 30,
                             "sync_batchnorm": True},
    "keras-dp-slow": {"mode": "keras-dp", "devices": ["cpu:0", "cpu:1"], "cores": [0, 1], "capacity": 1.5},
    "keras-dp-procs": {"mode": "keras-dp-procs", "devices": ["cpu:0", "cpu:1"]},
    "keras-dp-procs-slow": {"mode": "keras-dp-procs", "devices": ["cpu:0", "cpu:1@0.5"]},
}
TARGETS = [("mg2", "single", 1.8), ("mg1", "single", 0.97), ("mg2-slow-auto", "keras-dp-slow", 1.3),
           ("mg2-slow-auto", "mg2-slow-equal", 1.3), ("mg2", "keras-dp", 0.95),
           ("mg2-slow-auto", "keras-dp-procs-slow", 1.3), ("mg2", "keras-dp-procs", 0.95)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--auto-warmup", type=int, default=30, help="untimed steps of the automatic-shares run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "jax" / "jax.json"))
    a = p.parse_args()
    names = a.configs.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    began = time.monotonic()
    for round_ in range(a.rounds):
        for name in names:
            cfg = {"warmup": 3, **CONFIGS[name], "model": "convnet", "width": a.width, "batch": a.batch,
                   "steps": a.steps, "seed": 0}
            if cfg.get("ratios") == "auto":
                cfg["warmup"] = a.auto_warmup
            t0 = time.monotonic()
            result = run_config(cfg, timeout=900, stream=False, keep_log=cfg["mode"] == "multigpu")
            result["seconds"] = time.monotonic() - t0
            runs[name].append(result)
            extra = f" shares {result.get('shares')}" if result.get("shares") else ""
            print(f"round {round_ + 1} {name:<14} {result['samples_per_second']:8.1f} samples/s "
                  f"({result['seconds']:.0f} s){extra}", flush=True)
    rate = {n: statistics.median(r["samples_per_second"] for r in runs[n]) for n in names}
    print(f"\nconvnet width {a.width:g}, global batch {a.batch}, median of {a.rounds} round(s); "
          f"{(time.monotonic() - began) / 60:.1f} min")
    for n in names:
        print(f"  {n:<14} {rate[n]:8.1f} samples/s")
    checks = []
    for num, den, target in TARGETS:
        if num in rate and den in rate:
            ratio = rate[num] / rate[den]
            checks.append({"ratio": f"{num}/{den}", "value": ratio, "target": target, "met": ratio >= target})
            print(f"  {num}/{den}: {ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": platform.node(), "width": a.width, "batch": a.batch,
                                       "rounds": a.rounds, "rates": rate, "checks": checks, "runs": runs},
                                      indent=1, default=str))


if __name__ == "__main__":
    main()
