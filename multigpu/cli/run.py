"""``multigpu run``: start a training script once per device.

    multigpu run --devices cpu:0,cpu:1@0.5 --ratios 2,1 train.py --epochs 3

The launcher hosts the rendezvous store on 127.0.0.1 and a free port, starts
one process per device with the rank variables of :mod:`multigpu.env` set,
and waits.  If a rank fails, the others are stopped, and with
``--max-restarts K`` all ranks start again (the script resumes from its own
``BackupAndRestore`` state).  The exit code is the script's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from multigpu.devices import assign_cores, parse_devices
from multigpu.planning import validate_ratios
from multigpu.processes import RankGroup


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a training script on several devices")
    p.add_argument("--devices", "--gpus", default="auto",
                   help="comma-separated devices, e.g. 0,1 or cpu:0,cpu:1@0.5 (default: auto)")
    p.add_argument("--ratios", default=None,
                   help="comma-separated ratios, e.g. 3,1, or 'auto' (default: the script's choice)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all ranks up to K times after a failure")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def parse_ratios(text: str | None, n: int) -> list[float] | None:
    if text is None or text == "auto":
        return None
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--ratios takes comma-separated numbers such as 3,1. Received: {text!r}") from None
    return validate_ratios(values, n)


def run(args: argparse.Namespace) -> int:
    if not os.path.exists(args.script):
        raise ValueError(f"no such script: {args.script!r}; give the path of the Python script to run")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0. Received: {args.max_restarts}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0. Received: {args.timeout}")
    devices = assign_cores(parse_devices(args.devices))
    ratios = args.ratios if args.ratios in (None, "auto") else parse_ratios(args.ratios, len(devices))
    os.environ.setdefault("KERAS_BACKEND", "torch")
    command = [sys.executable, "-m", "multigpu.rank_entry", "script", args.script, *args.args]
    attempt: RankGroup | None = None

    def on_signal(signum, frame):
        if attempt is not None:
            attempt.stop(grace=3.0)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for restart in range(args.max_restarts + 1):
        attempt = RankGroup(command, devices, ratios, args.timeout)
        code, failed = attempt.wait()
        if failed is None:
            attempt.stop()
            return 0
        print(f"multigpu run: {attempt.describe_failure(code, failed)}; stopping the other ranks.",
              file=sys.stderr, flush=True)
        attempt.stop()
        if restart < args.max_restarts:
            print(f"multigpu run: restarting all ranks ({restart + 1} of {args.max_restarts}).",
                  file=sys.stderr, flush=True)
    return code if code > 0 else 1
