"""``multigpu run``: start a training script once per device.

    multigpu run --devices cpu:0,cpu:1@0.5 --ratios 2,1 train.py --epochs 3

The command is the run's supervisor (:mod:`multigpu.runtime.supervisor`): it
hosts the rendezvous on 127.0.0.1 and a free port, starts one process per
device, and waits.  If a rank fails, the others are stopped, and with
``--max-restarts K`` all ranks start again (the script resumes from its own
``BackupAndRestore`` state); in a run that may go on without a lost device
(``--min-devices N``), a lost rank's process starts again instead and
rejoins the others at a step of ``fit``.  The exit code is the script's.

Under an outside launcher (``srun -n 2 multigpu run train.py``, ``mpirun``,
torchrun) the process already is one rank of a run: it becomes that rank
(joining before the script runs, which JAX and TensorFlow need) instead of
starting ranks of its own.
"""

from __future__ import annotations

import argparse
import os
import sys

from multigpu import backend, env
from multigpu.devices import assign_cores, parse_devices
from multigpu.log import LEVELS, set_level
from multigpu.planning.shares import parse_ratios
from multigpu.runtime import environments
from multigpu.runtime.supervisor import Supervisor

# The flags of ``run`` that take a value, besides ``--devices``: the command line's scan for the script skips them.
VALUE_FLAGS = ("--ratios", "--timeout", "--max-restarts", "--min-devices", "--log-level")


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a training script on several devices", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", "--gpus", default="auto",
                   help="devices, e.g. 0,1 or 0 1 or cpu:0,cpu:1@0.5; the ranks run on these whatever the script "
                        "names (default: auto, every GPU)")
    p.add_argument("--ratios", default=None,
                   help="comma-separated ratios, e.g. 3,1, 'auto', or a profile .json; wins over the script's "
                        "(default: the script's choice)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a collective may wait; wins over the script's (default: the script's, else 60)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart all ranks up to K times after a failure; with --min-devices, start a lost rank "
                        "again instead (it rejoins at a step of fit)")
    p.add_argument("--min-devices", type=int, default=None,
                   help="go on without a lost device while this many are left; wins over the script's min_devices "
                        "(torch and TensorFlow; default: the script's, else a lost device ends the run)")
    p.add_argument("--log-level", default=None, choices=LEVELS,
                   help="multigpu's messages in every process of the run: debug, info (default), warning, error")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not os.path.exists(args.script):
        raise ValueError(f"no such script: {args.script!r}; give the path of the Python script to run")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0. Received: {args.max_restarts}")
    if args.timeout is not None and args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0. Received: {args.timeout}")
    if args.log_level is not None:  # the ranks read it when they import multigpu; this process at once
        env.put(env.LOG_LEVEL, args.log_level)
        set_level(args.log_level)
    found = environments.detect(env.copy())
    if found is not None and not found.knows_every_device:
        return _become_the_rank(args)
    devices = assign_cores(parse_devices(args.devices, num_gpus=backend.gpu_count))
    ratios = None if args.ratios is None else parse_ratios(args.ratios, len(devices)).text()
    if args.min_devices is not None:
        if not 1 <= args.min_devices <= len(devices):
            raise ValueError(f"--min-devices must be from 1 to the {len(devices)} devices. "
                             f"Received: {args.min_devices}")
        env.put(env.MIN_DEVICES, str(args.min_devices))
    env.set_default("KERAS_BACKEND", "torch")
    # The command line wins over the script's arguments (env.fallback): the ranks run on its devices, and its
    # ratios, timeout and min_devices replace the script's where given.
    env.given(env.DEVICES, *([env.RATIOS] if ratios is not None else []),
              *([env.TIMEOUT] if args.timeout is not None else []),
              *([env.MIN_DEVICES] if args.min_devices is not None else []))
    command = [sys.executable, "-m", "multigpu.runtime.rank_entry", "script", args.script, *args.args]
    supervisor = Supervisor(command, devices, args.timeout, ratios=ratios)
    return supervisor.run(max_restarts=args.max_restarts, prefix="multigpu run")


def _become_the_rank(args: argparse.Namespace) -> int:
    """This process is one rank of an outside launcher's run: it runs the script through the rank entry, with
    ``--devices``, ``--ratios`` and ``--timeout`` where given winning over the script's arguments."""
    if args.devices != "auto":
        env.put(env.DEVICES, args.devices)
        env.given(env.DEVICES)
    if args.ratios is not None:
        env.put(env.RATIOS, args.ratios)
        env.given(env.RATIOS)
    if args.timeout is not None:
        env.put(env.TIMEOUT, f"{args.timeout:g}")
        env.given(env.TIMEOUT)
    env.set_default("KERAS_BACKEND", "torch")
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "multigpu.runtime.rank_entry", "script", args.script,
                              *args.args])
    return 0  # pragma: no cover - execv does not return
