"""``multigpu run``: start a training script once per device.

    multigpu run --devices cpu:0,cpu:1@0.5 --ratios 2,1 train.py --epochs 3

The command is the run's supervisor (:mod:`multigpu.runtime.supervisor`): it
hosts the rendezvous on 127.0.0.1 and a free port, starts one process per
device, and waits.  If a rank fails, the others are stopped, and with
``--max-restarts K`` all ranks start again (the script resumes from its own
``BackupAndRestore`` state).  The exit code is the script's.
"""

from __future__ import annotations

import argparse
import os
import sys

from multigpu import backend
from multigpu.devices import assign_cores, parse_devices
from multigpu.planning.shares import parse_ratios
from multigpu.runtime.supervisor import Supervisor


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a training script on several devices")
    p.add_argument("--devices", "--gpus", default="auto",
                   help="comma-separated devices, e.g. 0,1 or cpu:0,cpu:1@0.5 (default: auto)")
    p.add_argument("--ratios", default=None,
                   help="comma-separated ratios, e.g. 3,1, 'auto', or a profile .json (default: the script's choice)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all ranks up to K times after a failure")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not os.path.exists(args.script):
        raise ValueError(f"no such script: {args.script!r}; give the path of the Python script to run")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0. Received: {args.max_restarts}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0. Received: {args.timeout}")
    devices = assign_cores(parse_devices(args.devices, num_gpus=backend.gpu_count))
    ratios = None if args.ratios is None else parse_ratios(args.ratios, len(devices)).text()
    os.environ.setdefault("KERAS_BACKEND", "torch")
    command = [sys.executable, "-m", "multigpu.runtime.rank_entry", "script", args.script, *args.args]
    supervisor = Supervisor(command, devices, args.timeout, ratios=ratios)
    return supervisor.run(max_restarts=args.max_restarts, prefix="multigpu run")
