"""A stacked GRU classifier on synthetic sequences: speedup across batch sizes, 1 and N devices.

    KERAS_BACKEND=torch python examples/gru_sequences.py                  # batch sizes 64 to 1024
    KERAS_BACKEND=torch python examples/gru_sequences.py --quick          # about a minute on 2 CPU cores
    KERAS_BACKEND=torch python examples/gru_sequences.py --devices cpu:0,cpu:1@0.5 --ratios auto

For every batch size it trains the same model (``multigpu.models.gru``: GRU, GRU, softmax)
on 1 device and on all devices (and 2 in between when there are more than 2), each
configuration in its own process: ``parallelize`` happens once per process, so the script
runs itself with a hidden ``--worker`` flag for each configuration and reads back a JSON
result.  It prints one table row per batch size and device count: accuracy, validation
accuracy, time per epoch and the speedup over one device at the same batch size.  A run on
fewer devices than listed uses the first ones, bound to the CPU cores they have in the
full run.
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
import numpy as np

import multigpu
from multigpu import env as multigpu_env
from multigpu.devices import Device, assign_cores, parse_devices
from multigpu.launch import die_with_parent
from multigpu.models import gru

TIMESTEPS, FEATURES, CLASSES = 40, 16, 4


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


def sizes_arg(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-sizes takes integers such as 64,256. Received: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes must be positive. Received: {text!r}")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=devices_arg, default="auto", help="comma-separated devices or 'auto'")
    p.add_argument("--ratios", type=ratios_arg, default=None, help="e.g. 3,1, or 'auto' (default: equal "
                   "shares for identical devices, measured otherwise)")
    p.add_argument("--batch-sizes", type=sizes_arg, default=None,
                   help="global batch sizes (default 64,128,256,512,1024; 64,256 with --quick)")
    p.add_argument("--rows", type=int, default=None,
                   help="sequences, a fifth held out (default 8192; 2048 with --quick)")
    p.add_argument("--epochs", type=int, default=None, help="default 3 (2 with --quick)")
    p.add_argument("--width", type=float, default=None,
                   help="GRU units scale (default 1.0 = 64 units; 0.5 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer, smaller runs: about a minute on CPU")
    p.add_argument("--worker", default=None, metavar="RESULT_JSON", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=None, help=argparse.SUPPRESS)  # the worker's
    a = p.parse_args(argv)
    defaults = {"batch_sizes": ([64, 128, 256, 512, 1024], [64, 256]), "rows": (8192, 2048),
                "epochs": (3, 2), "width": (1.0, 0.5)}
    for name, (full, quick) in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    if a.rows < 10 or a.epochs < 1 or a.width <= 0:
        p.error("--rows must be at least 10, --epochs positive, --width above 0")
    return a


# --------------------------------------------------------------------- worker
def make_sequences(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Noisy sequences whose class is the feature that is raised, weakly, at every step."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=rows)
    x = rng.normal(size=(rows, TIMESTEPS, FEATURES)).astype("float32")
    x[np.arange(rows), :, y] += 0.5
    return x, y.astype("int64")


class EpochTimer(keras.callbacks.Callback):
    """Wall time of each training epoch (without validation)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def worker(args: argparse.Namespace) -> None:
    """One configuration: trains on ``args.devices`` at ``args.batch_size``; rank 0 writes JSON."""
    keras.utils.set_random_seed(0)
    x, y = make_sequences(args.rows)
    model = gru(args.width, timesteps=TIMESTEPS, features=FEATURES, classes=CLASSES)
    model = multigpu.parallelize(model, devices=args.devices, ratios=args.ratios)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    timer = EpochTimer()
    hist = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, validation_split=0.2,
                     callbacks=[timer], verbose=0)
    if multigpu.rank() == 0:
        timed = timer.seconds[1:] if len(timer.seconds) > 1 else timer.seconds  # the first one warms up
        Path(args.worker).write_text(json.dumps({
            "batch_size": args.batch_size,
            "devices": multigpu.world_size(),
            "accuracy": float(hist.history["accuracy"][-1]),
            "val_accuracy": float(hist.history["val_accuracy"][-1]),
            "time": float(np.mean(timed)),
            "ratios": [float(r) for r in model._multigpu_state.ratios],
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
    with tempfile.TemporaryDirectory(prefix="gru-sequences-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, os.path.abspath(__file__), "--worker", str(out),
                   "--devices", ",".join(d.spec for d in devices), "--batch-size", str(batch_size),
                   "--rows", str(args.rows), "--epochs", str(args.epochs), "--width", str(args.width)]
        if ratios is not None:
            command += ["--ratios", ratios if isinstance(ratios, str) else ",".join(f"{r:g}" for r in ratios)]

        def bind() -> None:
            die_with_parent()
            if cores:  # these devices' cores in the full run, so 1 device means the first device's cores
                os.sched_setaffinity(0, cores)

        subprocess.run(command, env=independent_env(), preexec_fn=bind, check=True)
        return json.loads(out.read_text())


def device_counts(n: int) -> list[int]:
    return sorted({k for k in (1, 2, n) if k <= n})


def print_table(rows: list[dict]) -> None:
    print("\n| batch size | devices | accuracy | validation accuracy | time (s) | speed up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['devices']} | {r['accuracy']:.3f} | {r['val_accuracy']:.3f} | "
              f"{r['time']:.2f} | {r['speedup']:.2f} |")
    print("(time: seconds per training epoch, leaving out the first epoch when there are several; "
          "speed up: one device's time over this row's, at the same batch size)")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    devices = assign_cores(parse_devices(args.devices))
    counts = device_counts(len(devices))
    print(f"GRU on {args.rows} synthetic sequences of {TIMESTEPS}x{FEATURES}, {args.epochs} epoch(s), "
          f"devices {', '.join(d.label for d in devices)}; batch sizes {args.batch_sizes}", flush=True)
    rows = []
    for batch_size in args.batch_sizes:
        base = None
        for k in counts:
            ratios = args.ratios[:k] if isinstance(args.ratios, list) else args.ratios
            if k == 1:
                ratios = None
            result = run_worker(args, devices[:k], ratios, batch_size)
            base = result["time"] if k == 1 else base
            result["speedup"] = base / result["time"] if base else float("nan")
            rows.append(result)
            print(f"batch {batch_size:>5}, {k} device(s): accuracy {result['accuracy']:.3f}, "
                  f"validation accuracy {result['val_accuracy']:.3f}, {result['time']:.2f} s/epoch, "
                  f"speed up {result['speedup']:.2f}", flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
