"""Automatic shares against the best hand-tuned ratio, on several models and batches, side by side.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_balance.py            # ~45 min
    ... benchmarks/bench_balance.py --cases convnet:0.25:256 --no-slowdown                         # one case

Devices ``cpu:0`` and ``cpu:1@0.5`` (rank 1 under a cgroup CPU quota of half a core: needs root).
For every case (model:width:global batch), one configuration after another, each in fresh
processes (``multigpu.bench.runs.run_config``):

* **equal** shares (``ratios=[1, 1]``, no rebalancing);
* a **grid** of fixed shares of the fast device, 0.55 to 0.80 in steps of 0.05 (no rebalancing);
* **auto**: ``ratios="auto"`` with a fresh profile (calibration at the first step) and online
  rebalancing; its first steps (calibration and the search) are not timed, the steady rate after
  them is.

Every configuration runs the same number of untimed steps before its timed window (the auto
run's search length), so that no configuration is timed colder than another.

It reports auto / best grid point and auto / equal for each case.  The cases are the built-in
convnet, mlp and gru, each at two global batches, and ``benchmarks/outside_model.py``, a model
nothing in multigpu was tuned on.  Then the **slowdown** run: ``cpu:0`` and ``cpu:1`` at full speed
with automatic shares, ``cpu:1`` dropped to half a core after step 30; it reports how many steps
the 5-step throughput takes to come back to 0.9 of the best fixed ratio's throughput at half speed
(the convnet case of the grid).  Results: printed, and ``benchmarks/results/balance.json``.
"""

from __future__ import annotations

import argparse
import json
import os
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
GRID = [0.55, 0.60, 0.65, 0.70, 0.75, 0.80]


def parse_case(case: str) -> tuple[str, float, int]:
    model, width, batch = case.rsplit(":", 2)
    return model, float(width), int(batch)


def run(model: str, width: float, batch: int, ratios, steps: int, warmup: int) -> dict:
    cfg = {"mode": "multigpu", "model": model, "width": width, "batch": batch, "devices": DEVICES,
           "ratios": ratios, "steps": steps, "warmup": warmup, "seed": 0}
    return run_config(cfg, timeout=900, stream=False, keep_log=True)


def rate(model: str, width: float, batch: int, ratios, steps: int, warmup: int) -> float:
    return float(run(model, width, batch, ratios, steps, warmup)["samples_per_second"])


def run_case(case: str, seconds: float, log) -> dict:
    model, width, batch = parse_case(case)
    name = "outside" if model == OUTSIDE else model
    equal = rate(model, width, batch, [1, 1], 8, 2)
    step_time = batch / equal
    steps = int(min(300, max(10, seconds / step_time)))
    # The search needs a few windows of >= 1.5 s each; the auto run's untimed start covers them.
    search_steps = int(min(600, max(40, 40 / step_time)))
    # Every configuration gets the same untimed start as the auto run's search, so that a fixed share
    # is not timed earlier in its run (colder) than auto is.
    equal = rate(model, width, batch, [1, 1], steps, search_steps)
    log(f"{name} {batch}: equal {equal:.1f}/s ({steps} timed steps of {step_time * 1e3:.0f} ms "
        f"after {search_steps} untimed)")
    grid = {}
    for share in GRID:
        grid[share] = rate(model, width, batch, [share, 1 - share], steps, search_steps)
        log(f"{name} {batch}: fixed {share:.2f} {grid[share]:.1f}/s")
    result = run(model, width, batch, "auto", steps, search_steps)
    auto = float(result["samples_per_second"])
    shares = result.get("shares")
    best_share = max(grid, key=grid.get)
    log(f"{name} {batch}: auto {auto:.1f}/s = {auto / grid[best_share]:.3f} of the best fixed ({best_share:.2f}), "
        f"{auto / equal:.2f}x equal; auto's shares at the end {shares}")
    return {"case": case, "model": name, "width": width, "batch": batch, "equal": equal, "grid": grid, "auto": auto,
            "best_share": best_share, "auto_over_best": auto / grid[best_share], "auto_over_equal": auto / equal,
            "timed_steps": steps, "untimed_steps": search_steps, "auto_shares": shares,
            "auto_log": result.get("log", [])}


def slowdown(best_at_half: float, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-slowdown-") as tmp:
        out = Path(tmp) / "slowdown.json"
        env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
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
    head = ("| model | batch | equal | " + " | ".join(f"{s:.2f}" for s in GRID)
            + " | auto | auto / best | auto / equal |")
    lines = [head, "|---|---:|" + "---:|" * (len(GRID) + 4)]
    for r in results:
        best = r["best_share"]
        cells = [f"**{v:.1f}**" if s == best else f"{v:.1f}" for s, v in r["grid"].items()]
        lines.append(f"| {r['model']} (width {r['width']:g}) | {r['batch']} | {r['equal']:.1f} | " + " | ".join(cells)
                     + f" | {r['auto']:.1f} | {r['auto_over_best']:.3f} | {r['auto_over_equal']:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="*", default=CASES, help="model:width:batch (model: built-in or file.py:fn)")
    p.add_argument("--seconds", type=float, default=8.0, help="timed seconds per configuration (about)")
    p.add_argument("--no-slowdown", action="store_true", help="skip the mid-run slowdown run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "balance.json"))
    a = p.parse_args()
    start = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:5.0f} s] {message}", flush=True)

    log("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    results = [run_case(c, a.seconds, log) for c in a.cases]
    slow = None
    if not a.no_slowdown:
        convnet = next((r for r in results if r["model"] == "convnet" and r["batch"] == 256), None)
        best = max(convnet["grid"].values()) if convnet else rate("convnet", 0.25, 256, [0.67, 0.33], 20, 3)
        slow = slowdown(best, log)
    print("\nsamples/s on cpu:0 + cpu:1@0.5 (fixed shares: the fast device's share)\n" + table(results))
    print(f"\n{(time.monotonic() - start) / 60:.1f} min")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": sys.argv, "results": results, "slowdown": slow}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
