"""Which model and global batch make two unequal CPU devices pay: the sweep behind `make demo`.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_demo.py        # ~6 min
    ... benchmarks/bench_demo.py --model convnet --widths 0.25 0.5 --batches 64 128 256     # the bench convnet

The default model is the demo's own network (``benchmarks/demo_model.py``); ``--model convnet``
with ``--widths`` sweeps the filter widths of ``multigpu bench``'s convnet instead.

For each (width, global batch), one after another, each in fresh processes
(``multigpu.bench.runs.run_config``) on synthetic 28x28x1 data:

* one full-speed device alone (``cpu:0``, plain ``fit``);
* ``cpu:0`` + ``cpu:1@0.5`` (the demo's devices: the second at half a core) with automatic
  shares; the first steps (calibration, the share search) are not timed.

The speedup is the second over the first: the two devices' speed factors add up to 1.5, and
what is missing from 1.5x went to the two cores sharing caches and memory bandwidth, to waiting
and to per-step overhead.  Results: printed, and ``benchmarks/demo/demo-sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multigpu.bench.runs import run_config  # noqa: E402


def rate(model: str, mode: str, devices: list[str], width: float, batch: int, steps: int, warmup: int,
         ratios=None) -> float:
    cfg = {"mode": mode, "model": model, "width": width, "batch": batch, "devices": devices, "ratios": ratios,
           "steps": steps, "warmup": warmup, "seed": 0, "cores": [0]}  # one device alone: on core 0 only
    return float(run_config(cfg, timeout=900, stream=False)["samples_per_second"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "benchmarks" / "demo_model.py") + ":build",
                   help="built-in name or file.py:fn (default: the demo's network)")
    p.add_argument("--widths", nargs="+", type=float, default=[1.0], help="filter widths (built-in models)")
    p.add_argument("--batches", nargs="+", type=int, default=[128, 256, 512])
    p.add_argument("--seconds", type=float, default=8.0, help="timed seconds per configuration (about)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "demo" / "demo-sweep.json"))
    a = p.parse_args()
    start = time.monotonic()
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    rows = []
    for width in a.widths:
        for batch in a.batches:
            probe = rate(a.model, "single", ["cpu:0"], width, batch, 4, 1)
            steps = int(max(8, a.seconds * probe / batch))
            one = rate(a.model, "single", ["cpu:0"], width, batch, steps, 2)
            two = rate(a.model, "multigpu", ["cpu:0", "cpu:1@0.5"], width, batch, int(steps * 1.5),
                       int(max(12, 20 * one / batch)), "auto")
            rows.append({"model": Path(a.model.split(":")[0]).stem, "width": width, "batch": batch, "one": one,
                         "two": two, "speedup": two / one})
            print(f"width {width:g} batch {batch}: one device {one:.0f}/s, cpu:0 + cpu:1@0.5 {two:.0f}/s "
                  f"-> {two / one:.2f}x", flush=True)
    print("\n| model | width | global batch | one device (samples/s) | cpu:0 + cpu:1@0.5, auto | speedup |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['width']:g} | {r['batch']} | {r['one']:.0f} | {r['two']:.0f} "
              f"| {r['speedup']:.2f}x |")
    print(f"\n{(time.monotonic() - start) / 60:.1f} min")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
