"""A 41-million-parameter dense network: it pays off on several devices when the batch grows with them.

    KERAS_BACKEND=torch python examples/dense41m.py                     # the full model, batch 64 per device
    KERAS_BACKEND=torch python examples/dense41m.py --quick             # a narrow copy: about a minute on CPU
    KERAS_BACKEND=torch python examples/dense41m.py --devices cpu:0,cpu:1@0.5 --ratios 2,1

The model is ``multigpu.models.dense41m``: Dense(4000, tanh) on 8000 inputs, Dense(2000,
relu), Dense(500, relu), Dense(300, relu), Dense(1, sigmoid), trained with binary
cross-entropy and Adam on random data (``--width`` shrinks the hidden layers).  Every step
all-reduces 41 million gradients, so a small batch split over N devices mostly waits on
communication; a batch that grows with N keeps every device's share as large as the single
device's batch.  The script runs, each in its own processes (``parallelize`` happens once
per process, so it runs itself with a hidden ``--worker`` flag):

* 1 device at batch b,
* N devices at batch b (the same global batch, split), and
* N devices at batch N*b (scaled),

and prints samples/s and the speedup over one device for each.
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

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras

import multigpu
from multigpu import env as multigpu_env
from multigpu.devices import Device, assign_cores, parse_devices
from multigpu.launch import die_with_parent
from multigpu.models import dense41m, get_model


# ------------------------------------------------------------------ arguments
def devices_arg(text: str) -> str | list[str]:
    """``"auto"`` or a comma-separated device list."""
    text = text.strip()
    if text.lower() == "auto":
        return "auto"
    items = [d.strip() for d in text.split(",") if d.strip()]
    if not items:
        raise argparse.ArgumentTypeError("--devices takes 'auto' or comma-separated devices, e.g. cpu:0,cpu:1")
    return items


def ratios_arg(text: str) -> str | list[float]:
    """``"auto"`` or comma-separated positive numbers."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        values = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ratios takes 'auto' or numbers such as 3,1. Received: {text!r}") from None
    if not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"--ratios must be positive. Received: {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=devices_arg, default="auto", help="comma-separated devices or 'auto'")
    p.add_argument("--ratios", type=ratios_arg, default=None, help="e.g. 3,1, or 'auto' (default: equal "
                   "shares for identical devices, measured otherwise)")
    p.add_argument("--batch-size", type=int, default=None, help="b: the one-device batch (default 64; 32 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20; 10 with --quick)")
    p.add_argument("--warmup", type=int, default=2, help="steps not timed at the start of each run")
    p.add_argument("--width", type=float, default=None,
                   help="hidden-layer scale (default 1.0 = 41M parameters; 0.05 with --quick)")
    p.add_argument("--quick", action="store_true", help="a narrow model and few steps: about a minute on CPU")
    p.add_argument("--worker", default=None, metavar="RESULT_JSON", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    defaults = {"batch_size": (64, 32), "steps": (20, 10), "width": (1.0, 0.05)}
    for name, (full, quick) in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    if a.batch_size < 1 or a.steps < 2 or a.warmup < 0 or a.width <= 0:
        p.error("--batch-size must be positive, --steps at least 2, --warmup at least 0, --width above 0")
    return a


# --------------------------------------------------------------------- worker
class StepClock(keras.callbacks.Callback):
    """End time of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[float] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.ends.append(time.perf_counter())


def worker(args: argparse.Namespace) -> None:
    """Trains ``warmup + steps`` steps at global batch ``args.batch_size``; rank 0 writes samples/s."""
    keras.utils.set_random_seed(0)
    spec = get_model("dense41m")
    model = dense41m(args.width)
    model = multigpu.parallelize(model, devices=args.devices, ratios=args.ratios)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    x, y = spec.data(args.batch_size * (args.warmup + args.steps), 0)  # random inputs, a learnable label
    clock = StepClock()
    hist = model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, callbacks=[clock], verbose=0)
    if multigpu.rank() == 0:
        timed = clock.ends[args.warmup:] if len(clock.ends) > args.warmup + 1 else clock.ends
        rate = args.batch_size * (len(timed) - 1) / (timed[-1] - timed[0])
        Path(args.worker).write_text(json.dumps({
            "devices": multigpu.world_size(), "batch_size": args.batch_size,
            "shares": model._multigpu_state.shares_for(args.batch_size), "samples_per_second": rate,
            "parameters": model.count_params(), "loss": float(hist.history["loss"][-1]),
        }))


# --------------------------------------------------------------------- driver
def independent_env() -> dict[str, str]:
    """This environment without the variables that make a process a rank of a run."""
    drop = {multigpu_env.RANK, multigpu_env.WORLD_SIZE, multigpu_env.MASTER_ADDR, multigpu_env.MASTER_PORT,
            multigpu_env.DEVICES, multigpu_env.RATIOS, multigpu_env.LAUNCHER_PID,
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["KERAS_BACKEND"] = "torch"
    return env


def run_worker(args: argparse.Namespace, devices: list[Device], ratios: str | list[float] | None,
               batch_size: int) -> dict:
    """One configuration in fresh processes (the worker starts its other ranks itself)."""
    cores = sorted({c for d in devices for c in d.cores})
    with tempfile.TemporaryDirectory(prefix="dense41m-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, os.path.abspath(__file__), "--worker", str(out),
                   "--devices", ",".join(d.spec for d in devices), "--batch-size", str(batch_size),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width)]
        if ratios is not None:
            command += ["--ratios", ratios if isinstance(ratios, str) else ",".join(f"{r:g}" for r in ratios)]

        def bind() -> None:
            die_with_parent()
            if cores:  # these devices' cores in the full run, so 1 device means the first device's cores
                os.sched_setaffinity(0, cores)

        subprocess.run(command, env=independent_env(), preexec_fn=bind, check=True)
        return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    devices = assign_cores(parse_devices(args.devices))
    n, b = len(devices), args.batch_size
    if n < 2:
        print("dense41m needs at least two devices to compare; it found "
              f"{', '.join(d.label for d in devices)}.", flush=True)
    configs = [("1 device", devices[:1], None, b)]
    if n > 1:
        configs += [(f"{n} devices, same batch", devices, args.ratios, b),
                    (f"{n} devices, batch x{n}", devices, args.ratios, n * b)]
    print(f"dense41m at width {args.width} on {', '.join(d.label for d in devices)}: {args.steps} timed steps "
          f"per run after {args.warmup} warm-up steps", flush=True)
    results = []
    for name, devs, ratios, batch in configs:
        result = run_worker(args, devs, ratios, batch)
        result["name"] = name
        results.append(result)
        print(f"{name}: global batch {batch} {result['shares']}, {result['samples_per_second']:.1f} samples/s",
              flush=True)
    base = results[0]["samples_per_second"]
    print(f"\n{results[0]['parameters']:,} parameters")
    print(f"{'run':<26}{'global batch':>14}{'per device':>14}{'samples/s':>12}{'speed up':>10}")
    for r in results:
        per_device = "/".join(str(s) for s in r["shares"])
        print(f"{r['name']:<26}{r['batch_size']:>14}{per_device:>14}{r['samples_per_second']:>12.1f}"
              f"{r['samples_per_second'] / base:>9.2f}x")
    if n > 1:
        print(f"\nscaled batch: {results[2]['samples_per_second'] / base:.2f}x the samples/s of one device "
              f"on {n} devices ({results[2]['samples_per_second'] / base / n:.0%} scaling efficiency); "
              f"same batch: {results[1]['samples_per_second'] / base:.2f}x")


if __name__ == "__main__":
    main()
