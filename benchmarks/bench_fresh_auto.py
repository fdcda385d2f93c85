"""Automatic shares from a fresh profile against fixed ratios, in short runs, as a user meets them.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fresh_auto.py     # ~15 min
    ... benchmarks/bench_fresh_auto.py --auto-runs 1 --fixed 2,1                               # a quick look
    ... benchmarks/bench_fresh_auto.py --rounds 3 --models convnet,wide,mlp,gru               # four shapes, ~60 min

The outside convnet (``benchmarks/outside_model.py``: 32x32x3, four conv layers), global batch 128 (with
``--models``, also a wider convnet on 16x16x3, an MLP at batch 512 and a GRU classifier at batch 256, from the
same file), SGD, on ``cpu:0`` + ``cpu:1@0.5`` (needs root for the cgroup quota), 6 epochs of 16 steps (the MLP
64, the GRU 48: epochs of 4 to 8 s each), every run a plain ``python script.py`` in fresh processes
(``benchmarks/_fresh_auto.py``).  ``ratios="auto"`` starts from a fresh profile: calibration at the first
step, then the online search, all inside the fit.  Each configuration's figure is the samples/s of its last
epoch, end to end, with the step times of that epoch printed beside it, so that a stall shows instead of being
averaged away.

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


def run(ratios: str, epochs: int, steps: int, batch: int, model: str = "convnet", timeout: float = 900) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-fresh-auto-") as tmp:
        out = Path(tmp) / "out.json"
        env = dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "torch"), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--profile", str(Path(tmp) / "profile.json"),
                               "--ratios", ratios, "--epochs", str(epochs),
                               "--steps", str(steps), "--batch", str(batch), "--model", model],
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


def measure(model: str, batch: int, steps: int, a, log) -> dict:
    """Every configuration of one model, interleaved; its runs and summary (also written to its own file)."""
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
        r = run(config, a.epochs, steps, batch, model)
        runs.setdefault(config, []).append(r)
        series = " ".join(f"{s:.2f}" for s in r["steps"][-1])
        log(f"{model} {config:>6}: {r['samples_per_second']:6.1f} samples/s over the last epoch, shares "
            f"{r['shares']}, largest step {r['max_over_median']:.2f}x the median (last three epochs: "
            f"{r['tail_max_over_median']:.2f}x), last move after step {r['last_move']}; steps (s): {series}")
        if config == "auto":
            for line in r["log"]:
                log("    " + line)
    fixed = {c: statistics.median(r["samples_per_second"] for r in runs[c]) for c in a.fixed}
    best = max(fixed, key=fixed.get) if fixed else None
    equal = statistics.median(r["samples_per_second"] for r in runs["equal"])
    spreads = {}
    for config, rs in runs.items():
        rates = [r["samples_per_second"] for r in rs]
        spreads[config] = (max(rates) - min(rates)) / statistics.median(rates)
        if a.rounds > 1:
            stalls = ", ".join(f"{r['tail_max_over_median']:.2f}" for r in rs)
            moves = ", ".join(str(r["last_move"]) for r in rs)
            log(f"{model} {config:>6}: median {statistics.median(rates):6.1f} samples/s, runs "
                f"{', '.join(f'{v:.0f}' for v in rates)}, spread {spreads[config]:.0%}, largest step of the last "
                f"three epochs over their median {stalls}, last move after step {moves}")
    auto = statistics.median(r["samples_per_second"] for r in runs["auto"])
    log(f"{model}: automatic {auto:.1f} = {auto / fixed[best]:.3f}x the best fixed ({best}: {fixed[best]:.1f}), "
        f"{auto / equal:.2f}x equal ({equal:.1f})")
    summary = []
    for i, r in enumerate(runs.get("auto", [])):
        s = r["samples_per_second"]
        summary.append({"run": i + 1, "auto": s, "over_best": s / fixed[best] if best else None,
                        "over_equal": s / equal, "max_over_median": r["max_over_median"]})
    widest_fixed = max(spreads[c] for c in a.fixed)
    result = {"model": model, "batch": batch, "steps": steps, "fixed": fixed, "best": best, "equal": equal,
              "auto": auto, "over_best": auto / fixed[best], "auto_spread": spreads["auto"],
              "fixed_spread": widest_fixed, "summary": summary, "runs": runs}
    out = Path(a.out) if len(a.models) == 1 else Path(a.out).with_name(f"{Path(a.out).stem}-{model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": sys.argv, **result}, indent=1))
    return result


def main() -> int:
    from outside_model import BATCHES, BUILDERS, STEPS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--auto-runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, interleaved, and compare medians (issue 54: 3)")
    p.add_argument("--fixed", nargs="*", default=["2,1", "2.5,1", "3,1"], help="fixed ratios of the grid")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps", type=int, default=None, help="steps per epoch (default: the model's, "
                   + ", ".join(f"{m} {n}" for m, n in STEPS.items()) + ")")
    p.add_argument("--models", default="convnet", help=f"comma-separated, of {', '.join(BUILDERS)}")
    p.add_argument("--batch", type=int, default=None, help="the global batch (default: the model's, "
                   + ", ".join(f"{m} {b}" for m, b in BATCHES.items()) + ")")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "balance" / "fresh-auto.json"),
                   help="the results (with several models, one file each: OUT's name with -MODEL)")
    a = p.parse_args()
    a.models = a.models.split(",")
    unknown = [m for m in a.models if m not in BUILDERS]
    if unknown:
        p.error(f"--models takes {', '.join(BUILDERS)}. Received: {unknown}")
    start = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:5.0f} s] {message}", flush=True)

    log("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    results = [measure(m, a.batch or BATCHES[m], a.steps or STEPS[m], a, log) for m in a.models]
    print("\n| model | batch, steps an epoch | automatic (median) | best fixed (median) | automatic / best "
          "| spread: automatic, widest fixed |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['batch']}, {r['steps']} | {r['auto']:.1f} | {r['best']}: "
              f"{r['fixed'][r['best']]:.1f} | **{r['over_best']:.3f}x** | {r['auto_spread']:.0%}, "
              f"{r['fixed_spread']:.0%} |")
    print(f"\n{(time.monotonic() - start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
