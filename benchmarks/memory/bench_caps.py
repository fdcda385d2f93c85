"""Automatic shares that fit each device's memory against the best fixed ratio that fits, side by side.

``cpu:0/SIZE`` (fast, little memory) beside ``cpu:1@0.5`` (half speed, unbounded): CPU:0's speed share is about
two thirds, but SIZE holds about 45% of the global batch. Each round runs automatic shares from a fresh profile
and each fixed ratio of a sweep, interleaved; fixed ratios that do not fit end with their error and are left out.
Medians over the rounds (fresh processes here spread about +-15%).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_caps.py [--rounds 3] [--backend tensorflow|jax]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(devices: str, ratios: str, batch: int, epochs: int, folder: str, backend: str = "torch") -> dict | None:
    out = os.path.join(folder, "out.json")
    if os.path.exists(out):
        os.remove(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KERAS_BACKEND": backend,
           "MULTIGPU_PROFILE": os.path.join(folder, "profiles.json")}
    if os.path.exists(env["MULTIGPU_PROFILE"]):
        os.remove(env["MULTIGPU_PROFILE"])  # a fresh profile every run
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_caps_script.py"), devices, ratios, str(batch),
                           str(epochs), out], env=env, capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("multigpu:")]
    if proc.returncode != 0:
        return {"failed": next((line for line in lines if "ran out of memory" in line), lines[-1] if lines else "")}
    with open(out) as f:
        result = json.load(f)
    result["lines"] = lines
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory", default="64MiB")
    parser.add_argument("--batch", type=int, default=256, help="the first fit's batch; the second's is twice it")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--shares", default="30,35,40,45,50", help="CPU:0's fixed shares to sweep, in %%")
    parser.add_argument("--backend", default="torch", choices=["torch", "tensorflow", "jax"])
    args = parser.parse_args()
    devices = f"cpu:0/{args.memory},cpu:1@0.5"
    fixed = [int(s) for s in args.shares.split(",")]
    configs = ["auto", *[f"{s}:{100 - s}" for s in fixed]]
    rates: dict[str, list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="multigpu-bench-caps-") as folder:
        for k in range(args.rounds):
            for config in configs:
                got = run(devices, config, args.batch, args.epochs, folder, args.backend)
                if "failed" in got:
                    print(f"round {k + 1} {config:>6}: does not fit: {got['failed'][:160]}", flush=True)
                    rates[config].append(float("nan"))
                    continue
                rates[config].append(got["samples_per_second"])
                shares = "/".join(f"{s:.0%}" for s in got["shares"])
                extra = ""
                if config == "auto":
                    caps = [line for line in got["lines"] if "holds at most" in line or "out of memory" in line]
                    extra = f"  ({len(caps)} cap line(s); last: {caps[-1][10:110] if caps else '-'})"
                print(f"round {k + 1} {config:>6}: {got['samples_per_second']:7.0f} samples/s, shares {shares}{extra}",
                      flush=True)
    medians = {c: statistics.median(v) for c, v in rates.items() if v and not any(math.isnan(r) for r in v)}
    best = max((c for c in medians if c != "auto"), key=medians.get, default=None)
    print(f"{args.backend}, devices {devices}, batch {args.batch} then {2 * args.batch}, medians of {args.rounds} "
          "rounds:")
    for c, v in medians.items():
        print(f"  {c:>6}: {v:7.0f} samples/s")
    if best is not None and "auto" in medians:
        print(f"automatic shares / best fixed ratio that fits ({best}): {medians['auto'] / medians[best]:.3f}x")


if __name__ == "__main__":
    main()
