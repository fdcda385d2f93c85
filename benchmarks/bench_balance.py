"""Automatic shares against the best hand-tuned ratio, on several models and batches, side by side.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_balance.py            # ~60 min
    ... benchmarks/bench_balance.py --cases convnet:0.25:256 --no-slowdown                         # one case
    KERAS_BACKEND=tensorflow ... benchmarks/bench_balance.py --cases convnet:0.25:256 mlp:0.5:1024 --no-slowdown

Devices ``cpu:0`` and ``cpu:1@0.5`` (rank 1 under a cgroup CPU quota of half a core: needs root).
For every case (model:width:global batch), one configuration after another, each in fresh
processes (``multigpu.bench.runs.run_config``):

* a **grid** of fixed shares of the fast device, 0.50 (equal shares) to 0.95 in steps of 0.05,
  timed in one process: after the untimed start, the shares move at step boundaries (the same
  steps on every rank) through the grid and back, each point timed in a window of its own
  (``--seconds``/2) twice; a point's rate is the mean of its two windows.  Timing every point in
  one warm process, interleaved, keeps process-to-process noise (up to 40% between neighbouring
  points when each ran in a process of its own) out of the comparison;
* **head to head**: ``--rounds`` rounds (2), each of three runs in fresh processes, one after
  another, the order turned round every round: **auto** (``ratios="auto"`` with a fresh profile:
  calibration at the first step, then the online search), the grid's **best** point as fixed
  shares, and **equal** shares.  All three run the same untimed start (calibration and the search,
  for auto) and the same timed steps after it (``--seconds``); a configuration's rate is the
  median of its rounds.

The grid's process runs as many untimed steps before its first window as the runs head to head.
The grid only *finds* the best point; it is timed again head to head because the highest of ten
noisy points is biased upward (the luckiest window wins), and because a rate in a warm process
that moves its shares every few seconds is not the rate of a run at fixed shares from the start:
comparing auto's own run with the grid's highest window measured both effects, not the search.

Every head-to-head run prints its timed steps' seconds beside its mean, with the largest step over
the median, so that a stall is seen rather than averaged away.  It reports auto / best and auto /
equal head to head for each case, and, for reference, auto over
the grid's highest point. The cases are the built-in convnet, mlp and gru, each at two global
batches, and ``benchmarks/outside_model.py``, a model nothing in multigpu was tuned on. Then the
**slowdown** run: ``cpu:0`` and ``cpu:1`` at full speed with automatic shares, ``cpu:1`` dropped
to half a core after step 30; it reports how many steps the 5-step throughput takes to come back
to 0.9 of the best fixed ratio's throughput at half speed (the convnet case of the grid). Results:
printed, and ``benchmarks/balance/balance.json``.
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
sys.path.insert(0, str(ROOT))

from multigpu.bench.runs import run_config  # noqa: E402

DEVICES = ["cpu:0", "cpu:1@0.5"]
OUTSIDE = str(ROOT / "benchmarks" / "outside_model.py") + ":build"
CASES = ["convnet:0.25:128", "convnet:0.25:256", "mlp:0.5:256", "mlp:0.5:1024", "gru:1:64", "gru:1:256",
         f"{OUTSIDE}:1:128"]
GRID = [0.50, 0.55, 0.60, 0.65, 0.70, 0.75, 0.80, 0.85, 0.90, 0.95]


def parse_case(case: str) -> tuple[str, float, int]:
    model, width, batch = case.rsplit(":", 2)
    return model, float(width), int(batch)


def run(model: str, width: float, batch: int, ratios, steps: int, warmup: int, **extra) -> dict:
    cfg = {"mode": "multigpu", "model": model, "width": width, "batch": batch, "devices": DEVICES,
           "ratios": ratios, "steps": steps, "warmup": warmup, "seed": 0, **extra}
    return run_config(cfg, timeout=1800, stream=False, keep_log=True)


def sweep(model: str, width: float, batch: int, window: int, warmup: int, passes: int) -> dict[float, list[float]]:
    """Samples/s of every grid point, timed in one warm process, ``passes`` times, each pass reversing the order."""
    order = [s for p in range(passes) for s in (GRID if p % 2 == 0 else GRID[::-1])]
    result = run(model, width, batch, [GRID[0], 1 - GRID[0]], len(order) * (window + 2) + 1, warmup,
                 sweep=order, window_steps=window)
    rates: dict[float, list[float]] = {s: [] for s in GRID}
    for share, value in result["sweep"]:
        rates[round(share, 2)].append(value)
    return rates


def step_series(times: list[float]) -> str:
    """The timed steps' seconds, with the largest over the median: a stall shows instead of being averaged away."""
    if not times:
        return "no step times"
    return (f"largest step {max(times) / statistics.median(times):.2f}x the median; steps (s): "
            + " ".join(f"{t:.2f}" for t in times))


def run_case(case: str, seconds: float, rounds: int, log) -> dict:
    model, width, batch = parse_case(case)
    name = "outside" if model == OUTSIDE else model
    step_time = batch / float(run(model, width, batch, [1, 1], 8, 2)["samples_per_second"])
    steps = int(min(300, max(10, seconds / step_time)))
    window = int(min(150, max(4, seconds / 2 / step_time)))
    # The search needs several windows of >= 1.5 s each (longer where the machine is noisy); the
    # untimed start of every run covers them (about 45 s), so that no configuration is timed colder.
    search_steps = int(min(3000, max(40, 45 / step_time)))
    rates = sweep(model, width, batch, window, search_steps, 2)
    grid = {share: sum(v) / len(v) for share, v in rates.items() if v}
    for share in GRID:
        windows = ", ".join(f"{v:.0f}" for v in rates[share])
        log(f"{name} {batch}: fixed {share:.2f} {grid[share]:.1f}/s (windows {windows})")
    best_share = max(grid, key=grid.get)
    configs = {"auto": "auto", "best": [best_share, 1 - best_share], "equal": [1, 1]}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for i in range(rounds):
        for config in (list(configs) if i % 2 == 0 else list(configs)[::-1]):
            result = run(model, width, batch, configs[config], steps, search_steps)
            runs[config].append(result)
            shares = f", shares at the end {result.get('shares')}" if config == "auto" else ""
            log(f"{name} {batch}: round {i + 1}: {config} {result['samples_per_second']:.1f}/s{shares}; "
                + step_series(result.get("step_times") or []))

    def median(config: str) -> float:
        return statistics.median(float(r["samples_per_second"]) for r in runs[config])

    auto, best, equal = median("auto"), median("best"), median("equal")
    log(f"{name} {batch}: auto {auto:.1f}/s = {auto / best:.3f} of the best fixed ({best_share:.2f}: {best:.1f}/s), "
        f"{auto / equal:.2f}x equal ({equal:.1f}/s); {auto / grid[best_share]:.3f} of the grid's highest point")
    return {"case": case, "model": name, "width": width, "batch": batch, "grid": grid, "grid_windows": rates,
            "best_share": best_share, "auto": auto, "best": best, "equal": equal,
            "auto_over_best": auto / best, "auto_over_equal": auto / equal,
            "auto_over_grid_best": auto / grid[best_share],
            "runs": {k: [float(r["samples_per_second"]) for r in v] for k, v in runs.items()},
            "timed_steps": steps, "window_steps": window, "untimed_steps": search_steps,
            "auto_shares": [r.get("shares") for r in runs["auto"]],
            "step_times": {k: [r.get("step_times") for r in v] for k, v in runs.items()},
            "auto_log": [r.get("log", []) for r in runs["auto"]]}


def slowdown(best_at_half: float, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-slowdown-") as tmp:
        out = Path(tmp) / "slowdown.json"
        env = dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "torch"), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1", "--ratios",
                               "auto", str(ROOT / "benchmarks" / "_slowdown.py"), str(out), "--steps", "110",
                               "--slow-after", "30"], env=env, capture_output=True, text=True, timeout=900,
                              check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"slowdown run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
    ends, batch, after = data["ends"], data["batch"], data["slow_after"]
    window = 5
    recovered = None
    for i in range(after + window, len(ends)):
        rolling = batch * window / (ends[i] - ends[i - window])
        if rolling >= 0.9 * best_at_half:
            recovered = i - after
            break
    moves = [i + 1 for i in range(1, len(data["shares"])) if data["shares"][i] != data["shares"][i - 1]]
    log(f"slowdown: back to 0.9 of {best_at_half:.1f}/s after {recovered} steps; shares moved at steps {moves}; "
        f"shares {data['shares'][after - 1]} before, {data['shares'][-1]} at the end")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("multigpu:")]
    return {"steps_to_recover": recovered, "share_moves": moves, "log": lines, "shares": data["shares"]}


def table(results: list[dict]) -> str:
    head = ("| model | batch | " + " | ".join(f"{s:.2f}" for s in GRID)
            + " | auto | best | equal | auto / best | auto / equal | auto / grid's highest |")
    lines = [head, "|---|---:|" + "---:|" * (len(GRID) + 6)]
    for r in results:
        top = r["best_share"]
        cells = [f"**{r['grid'][s]:.0f}**" if s == top else f"{r['grid'][s]:.0f}" for s in GRID]
        lines.append(f"| {r['model']} (width {r['width']:g}) | {r['batch']} | " + " | ".join(cells)
                     + f" | {r['auto']:.1f} | {r['best']:.1f} | {r['equal']:.1f} | {r['auto_over_best']:.3f} | "
                     f"{r['auto_over_equal']:.2f}x | {r['auto_over_grid_best']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="*", default=CASES, help="model:width:batch (model: built-in or file.py:fn)")
    p.add_argument("--seconds", type=float, default=8.0, help="timed seconds per configuration (about)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of auto, best and equal head to head")
    p.add_argument("--no-slowdown", action="store_true", help="skip the mid-run slowdown run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "balance" / "balance.json"))
    a = p.parse_args()
    start = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:5.0f} s] {message}", flush=True)

    log("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    results = []
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for case in a.cases:  # written after every case: a case that fails later loses nothing measured before it
        results.append(run_case(case, a.seconds, a.rounds, log))
        Path(a.out).write_text(json.dumps({"command": sys.argv, "results": results, "slowdown": None}, indent=1))
    slow = None
    if not a.no_slowdown:
        convnet = next((r for r in results if r["model"] == "convnet" and r["batch"] == 256), None)
        best = (convnet["best"] if convnet
                else float(run("convnet", 0.25, 256, [0.67, 0.33], 20, 3)["samples_per_second"]))
        slow = slowdown(best, log)
    print("\nsamples/s on cpu:0 + cpu:1@0.5 (fixed shares: the fast device's share)\n" + table(results))
    print(f"\n{(time.monotonic() - start) / 60:.1f} min")
    Path(a.out).write_text(json.dumps({"command": sys.argv, "results": results, "slowdown": slow}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
