"""What a hand-written ``train_step`` costs against the built-in step, side by side in one run.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_custom_step.py   # ~4 min

Model: the built-in convnet (width 0.25) as it is (``builtin``) and in a subclass whose
``train_step`` does forward, ``compute_loss``, ``backward``, ``optimizer.apply`` and
``compute_metrics`` by hand (``custom``; ``benchmarks/custom_step_model.py``).  Devices ``cpu:0`` +
``cpu:1``, equal shares, global batch 256.  The two run in alternation (A B A B ...), each in fresh
processes, so that a drift of the machine's speed falls on both; the ratio of the medians is reported.
Results: printed, and ``benchmarks/custom_step/custom_step.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multigpu.bench.runs import run_config  # noqa: E402

MODEL = str(ROOT / "benchmarks" / "custom_step_model.py")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "custom_step" / "custom_step.json"))
    a = p.parse_args()
    start = time.monotonic()
    rates: dict[str, list[float]] = {"builtin": [], "custom": []}
    for i in range(a.rounds):
        for name, got in rates.items():
            cfg = {"mode": "multigpu", "model": f"{MODEL}:{name}", "width": 1.0, "batch": a.batch,
                   "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "steps": a.steps, "warmup": 3, "seed": 0}
            rate = float(run_config(cfg, timeout=900, stream=False)["samples_per_second"])
            got.append(rate)
            print(f"[{time.monotonic() - start:4.0f} s] round {i + 1} {name}: {rate:.1f} samples/s", flush=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    extra = medians["builtin"] / medians["custom"] - 1
    print(f"median samples/s: built-in {medians['builtin']:.1f}, custom {medians['custom']:.1f}; "
          f"a custom step costs {extra:+.1%} per step")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": sys.argv, "rates": rates, "medians": medians,
                                       "custom_step_extra_cost": extra}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
