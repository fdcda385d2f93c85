"""Automatic shares from a fresh profile against fixed ratios, in short runs, as a user meets them.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fresh_auto.py     # ~15 min
    ... benchmarks/bench_fresh_auto.py --auto-runs 1 --fixed 2,1                               # a quick look

The outside convnet (``benchmarks/outside_model.py``: 32x32x3, four conv layers), global batch 128,
SGD, on ``cpu:0`` + ``cpu:1@0.5`` (needs root for the cgroup quota), 6 epochs of 16 steps, every run
a plain ``python script.py`` in fresh processes (``benchmarks/_fresh_auto.py``).  ``ratios="auto"``
starts from a fresh profile: calibration at the first step, then the online search, all inside the
96 steps.  Each configuration's figure is the samples/s of its last epoch, end to end, with the step
times of that epoch printed beside it, so that a stall shows instead of being averaged away.

Prints, for every auto run: auto over the best fixed ratio of the grid and over equal shares, and
the largest step of the last epoch over its median.  Results: ``benchmarks/balance/fresh-auto.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "_fresh_auto.py"


def run(ratios: str, epochs: int, steps: int, batch: int, timeout: float = 900) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-fresh-auto-") as tmp:
        out = Path(tmp) / "out.json"
        env = dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "torch"), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--profile", str(Path(tmp) / "profile.json"),
                               "--ratios", ratios, "--epochs", str(epochs),
                               "--steps", str(steps), "--batch", str(batch)],
                              env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"run {ratios} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
    result["log"] = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if ln.startswith("multigpu:")]
    last = result["steps"][-1]
    result["max_over_median"] = max(last) / statistics.median(last)
    tail = [t for epoch in result["steps"][-3:] for t in epoch]  # the last three epochs
    result["tail_max_over_median"] = max(tail) / statistics.median(tail)
    by_step = result.get("shares_by_step", [])
    # The step after which the shares last changed (1-based; the calibration's step counts).
    result["last_move"] = max((i + 1 for i in range(1, len(by_step)) if by_step[i] != by_step[i - 1]), default=1)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--auto-runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, interleaved, and compare medians (issue 54: 3)")
    p.add_argument("--fixed", nargs="*", default=["2,1", "2.5,1", "3,1"], help="fixed ratios of the grid")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps", type=int, default=16, help="steps per epoch")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "balance" / "fresh-auto.json"))
    a = p.parse_args()
    start = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:5.0f} s] {message}", flush=True)

    log("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    order = ["equal", *a.fixed]
    runs: dict[str, list[dict]] = {}
    # Interleaved: auto, then a fixed configuration, so that a drift of the machine touches both alike.
    schedule = []
    if a.rounds > 1:  # every configuration once a round, auto first
        schedule = ["auto", *order] * a.rounds
    else:
        for i in range(max(a.auto_runs, len(order))):
            if i < a.auto_runs:
                schedule.append("auto")
            if i < len(order):
                schedule.append(order[i])
    for config in schedule:
        r = run(config, a.epochs, a.steps, a.batch)
        runs.setdefault(config, []).append(r)
        series = " ".join(f"{s:.2f}" for s in r["steps"][-1])
        log(f"{config:>6}: {r['samples_per_second']:6.1f} samples/s over the last epoch, shares {r['shares']}, "
            f"largest step {r['max_over_median']:.2f}x the median (last three epochs: "
            f"{r['tail_max_over_median']:.2f}x), last move after step {r['last_move']}; steps (s): {series}")
        if config == "auto":
            for line in r["log"]:
                log("    " + line)
    fixed = {c: statistics.median(r["samples_per_second"] for r in runs[c]) for c in a.fixed}
    best = max(fixed, key=fixed.get) if fixed else None
    equal = statistics.median(r["samples_per_second"] for r in runs["equal"])
    if a.rounds > 1:
        for config, rs in runs.items():
            rates = [r["samples_per_second"] for r in rs]
            spread = (max(rates) - min(rates)) / statistics.median(rates)
            stalls = ", ".join(f"{r['tail_max_over_median']:.2f}" for r in rs)
            moves = ", ".join(str(r["last_move"]) for r in rs)
            log(f"{config:>6}: median {statistics.median(rates):6.1f} samples/s, runs "
                f"{', '.join(f'{v:.0f}' for v in rates)}, spread {spread:.0%}, "
                f"largest step of the last three epochs over their median {stalls}, last move after step {moves}")
        auto = statistics.median(r["samples_per_second"] for r in runs["auto"])
        log(f"medians of {a.rounds} rounds: automatic {auto:.1f} = {auto / fixed[best]:.3f}x the best fixed ({best}: "
            f"{fixed[best]:.1f}), {auto / equal:.2f}x equal ({equal:.1f})")
    summary = []
    for i, r in enumerate(runs.get("auto", [])):
        s = r["samples_per_second"]
        line = {"run": i + 1, "auto": s, "over_best": s / fixed[best] if best else None, "over_equal": s / equal,
                "max_over_median": r["max_over_median"]}
        summary.append(line)
        log(f"auto run {i + 1}: {s:.1f} samples/s = {line['over_best']:.3f} of the best fixed ({best}: "
            f"{fixed[best]:.1f}), {line['over_equal']:.2f}x equal ({equal:.1f}); largest last-epoch step "
            f"{r['max_over_median']:.2f}x the median")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": sys.argv, "fixed": fixed, "best": best, "equal": equal,
                                       "summary": summary, "runs": runs}, indent=1))
    print(f"\n{(time.monotonic() - start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
