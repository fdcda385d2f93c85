"""Gradient compression: its speed on a communication-heavy model, and its weight error against the exact run.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compression.py     # ~8 min

1. **Speed**: ``dense41m`` (41 million weights) at a global batch of 256 on ``cpu:0`` and
   ``cpu:1``, equal shares, in fresh processes one after another, ``--rounds`` rounds (median):
   plain Keras ``fit`` on one core, multigpu exact, ``compression="bf16"`` and ``"fp16"`` (over
   shared memory, the default on one machine), and exact and bf16 over gloo (TCP, as between
   machines).
2. **Weight error**: ``tests/scripts/exactness.py`` (Conv2D, GRU, Embedding, Dense, an L2
   regulariser) trained ``--steps`` steps of batch 64 with SGD and with Adam, once on one device
   with plain Keras and then on two devices at shares 3:1, exact and with each compression, over
   shared memory and over gloo.  Reported: the relative error of all weights,
   ``|w - w_plain| / |w_plain|``, and the last epoch's loss.

Results: printed tables, and ``benchmarks/compression/compression.json``.
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

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multigpu.bench.runs import run_config  # noqa: E402

SPEED = {
    "single": {"mode": "single", "devices": ["cpu:0"], "cores": [0]},
    "exact": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1]},
    "bf16": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "compression": "bf16"},
    "fp16": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "compression": "fp16"},
    "exact gloo": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "transport": "gloo"},
    "bf16 gloo": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "compression": "bf16",
                  "transport": "gloo"},
}
ERROR_RUNS = [("exact", None, "auto"), ("bf16", "bf16", "auto"), ("fp16", "fp16", "auto"),
              ("exact gloo", None, "gloo"), ("bf16 gloo", "bf16", "gloo"), ("fp16 gloo", "fp16", "gloo")]


def speed(rounds: int, steps: int) -> dict:
    rates: dict[str, list[float]] = {name: [] for name in SPEED}
    for r in range(rounds):
        for name, base in SPEED.items():
            cfg = dict(base, model="dense41m", width=1.0, batch=256, steps=steps, warmup=3, seed=0)
            os.environ["MULTIGPU_TRANSPORT"] = cfg.pop("transport", "auto")
            try:
                rate = float(run_config(cfg, timeout=900, stream=False)["samples_per_second"])
            finally:
                del os.environ["MULTIGPU_TRANSPORT"]
            rates[name].append(rate)
            print(f"  speed round {r + 1} {name:7s} {rate:7.1f} samples/s", flush=True)
    return {name: {"rounds": v, "median": statistics.median(v)} for name, v in rates.items()}


def _train(out: Path, extra: list[str], steps: int, transport: str = "auto") -> dict:
    rows = 64 * steps // 4  # 4 epochs
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "exactness.py"), str(out), "--rows", str(rows),
           "--epochs", "4", "--batch", "64", *extra]
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MULTIGPU_TRANSPORT=transport)
    subprocess.run(cmd, check=True, timeout=900, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return dict(np.load(out))


def weight_errors(steps: int) -> dict:
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-compression-") as tmp:
        plain = _train(Path(tmp) / "plain.npz", ["--plain"], steps)
        for name, compression, transport in ERROR_RUNS:
            extra = ["--devices", "cpu:0,cpu:1", "--ratios", "3,1"]
            if compression:
                extra += ["--compression", compression]
            got = _train(Path(tmp) / f"{name.replace(' ', '-')}.npz", extra, steps, transport)
            out[name] = {}
            for opt in ("sgd", "adam"):
                keys = sorted(k for k in plain if k.startswith(f"{opt}.w"))
                ref = np.concatenate([plain[k].ravel() for k in keys]).astype(np.float64)
                val = np.concatenate([got[k].ravel() for k in keys]).astype(np.float64)
                loss = json.loads(str(got[f"{opt}.history"]))["loss"][-1]
                ref_loss = json.loads(str(plain[f"{opt}.history"]))["loss"][-1]
                out[name][opt] = {"weight_error": float(np.linalg.norm(val - ref) / np.linalg.norm(ref)),
                                  "loss": loss, "plain_loss": ref_loss}
                print(f"  {name:10s} {opt:4s} relative weight error {out[name][opt]['weight_error']:.2e}, "
                      f"last epoch's loss {loss:.6f} (one device {ref_loss:.6f})", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--speed-steps", type=int, default=8, help="timed steps of dense41m per run")
    p.add_argument("--steps", type=int, default=100, help="training steps for the weight error")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "compression" / "compression.json"))
    a = p.parse_args()
    start = time.monotonic()
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    errors = weight_errors(a.steps)
    rates = speed(a.rounds, a.speed_steps)
    single = rates["single"]["median"]
    print("\n| dense41m, batch 256 | samples/s (median) | / one device | / exact |\n|---|---:|---:|---:|")
    for name, r in rates.items():
        print(f"| {name} | {r['median']:.1f} | {r['median'] / single:.2f}x | "
              f"{r['median'] / rates['exact']['median']:.2f}x |")
    print(f"\n| {a.steps} steps, shares 3:1 | SGD weight error | Adam weight error |\n|---|---:|---:|")
    for name, e in errors.items():
        print(f"| {name} | {e['sgd']['weight_error']:.2e} | {e['adam']['weight_error']:.2e} |")
    print(f"\n{(time.monotonic() - start) / 60:.1f} min")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": sys.argv, "speed": rates, "weight_error": errors,
                                       "steps": a.steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
