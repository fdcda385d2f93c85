"""Helpers shared by the examples: command-line arguments, runs in fresh processes, timing and tables.

The examples are run as ``python examples/NAME.py``, which puts this folder on ``sys.path``, so
they import it as ``from _common import ...``.  Everything here is plumbing around an example;
the model, the ``multigpu.parallelize`` call and the training stay in each example.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")  # as in every example, should this module be imported first

import keras
import numpy as np

from multigpu import env as multigpu_env
from multigpu.devices import Device
from multigpu.runtime.processes import die_with_parent

DEFAULT_RATIOS_HELP = "e.g. 3,1, or 'auto' (default: equal shares for identical devices, measured otherwise)"


# ------------------------------------------------------------------ arguments
def devices_arg(text: str, example: str = "cpu:0,cpu:1") -> str | list[str]:
    """Parses ``--devices``: ``"auto"`` or a comma-separated device list.

    Args:
        text: the argument as given.
        example: a valid list, quoted in the error message.

    Returns:
        ``"auto"``, or the device names with surrounding spaces removed.

    Raises:
        argparse.ArgumentTypeError: if the list names no device.
    """
    text = text.strip()
    if text.lower() == "auto":
        return "auto"
    items = [d.strip() for d in text.split(",") if d.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"--devices takes 'auto' or comma-separated devices, e.g. {example}")
    return items


def ratios_arg(text: str) -> str | list[float]:
    """Parses ``--ratios``: ``"auto"`` or comma-separated positive numbers.

    Args:
        text: the argument as given.

    Returns:
        ``"auto"``, or the ratios as floats.

    Raises:
        argparse.ArgumentTypeError: if a value is not a number or not positive.
    """
    if text.strip().lower() == "auto":
        return "auto"
    try:
        values = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ratios takes 'auto' or numbers such as 3,1. Received: {text!r}") from None
    if not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"--ratios must be positive. Received: {text!r}")
    return values


def add_device_arguments(parser: argparse.ArgumentParser, ratios_default: str | None = None,
                         ratios_help: str = DEFAULT_RATIOS_HELP, devices_example: str = "cpu:0,cpu:1") -> None:
    """Adds ``--devices`` (default ``"auto"``) and ``--ratios`` to ``parser``.

    Args:
        parser: the example's parser.
        ratios_default: the default of ``--ratios`` (``None``: ``parallelize`` decides).
        ratios_help: the help text of ``--ratios``.
        devices_example: a valid device list, quoted when ``--devices`` names none.
    """
    devices_type: Callable[[str], str | list[str]] = functools.partial(devices_arg, example=devices_example)
    parser.add_argument("--devices", type=devices_type, default="auto", help="comma-separated devices or 'auto'")
    parser.add_argument("--ratios", type=ratios_arg, default=ratios_default, help=ratios_help)


def apply_quick_defaults(args: argparse.Namespace, defaults: dict[str, tuple[object, object]]) -> None:
    """Fills in the options left unset (``None``), with their ``--quick`` values when ``args.quick``.

    Args:
        args: the parsed arguments, changed in place.
        defaults: for each attribute name, its (full run, ``--quick``) default.
    """
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def ratios_text(ratios: str | Sequence[float]) -> str:
    """``--ratios`` as it is written on a command line: ``"auto"`` or numbers such as ``"3,1"``."""
    return ratios if isinstance(ratios, str) else ",".join(f"{r:g}" for r in ratios)


# ------------------------------------------------------------ fresh processes
def independent_env() -> dict[str, str]:
    """This environment without the variables that make a process a rank of a run.

    Returns:
        A copy of ``os.environ`` for a process that starts a run of its own, on this process's Keras backend.
    """
    drop = {*multigpu_env.RUN_VARS, multigpu_env.STORE_FD,
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["KERAS_BACKEND"] = keras.backend.backend()
    return env


def run_worker(script: str, devices: Sequence[Device], options: Sequence[str], *,
               ratios: str | Sequence[float] | None = None, result_flag: str = "--worker",
               prefix: str = "example-") -> dict:
    """Runs ``script`` on ``devices`` in fresh processes and returns the JSON result it writes.

    The command is ``python SCRIPT --devices SPECS [--ratios R] OPTIONS RESULT_FLAG PATH``; the
    script trains (starting its other ranks itself, as ``parallelize`` does) and writes its
    result to ``PATH`` as JSON.  The process is bound to the CPU cores the devices have (so that
    fewer devices than in the full run keep the cores they have there) and dies with this one.

    Args:
        script: the example's file, usually ``__file__``.
        devices: the devices to train on, with their cores assigned.
        options: the script's other command-line arguments.
        ratios: ``--ratios`` for the run, or ``None`` to leave it out.
        result_flag: the script's option that names the result file.
        prefix: the prefix of the temporary folder holding the result.

    Returns:
        The script's result.

    Raises:
        subprocess.CalledProcessError: if the script fails.
    """
    cores = sorted({c for d in devices for c in d.cores})
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, os.path.abspath(script), "--devices", ",".join(d.spec for d in devices)]
        if ratios is not None:
            command += ["--ratios", ratios_text(ratios)]
        command += [*options, result_flag, str(out)]

        def bind() -> None:
            die_with_parent()
            if cores:  # these devices' cores in the full run, so 1 device means the first device's cores
                os.sched_setaffinity(0, cores)

        subprocess.run(command, env=independent_env(), preexec_fn=bind, check=True)
        return json.loads(out.read_text())


# --------------------------------------------------------------------- timing
class EpochTimer(keras.callbacks.Callback):
    """Wall time of each training epoch (without validation), in ``seconds``."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def steady_epoch_time(seconds: Sequence[float]) -> float:
    """Mean epoch time, leaving out the first epoch (warm-up) when there are more.

    Args:
        seconds: the time of each epoch, as :class:`EpochTimer` measures it.

    Returns:
        The mean in seconds.
    """
    timed = seconds[1:] if len(seconds) > 1 else seconds
    return float(np.mean(timed))


# --------------------------------------------------------------------- output
def shares_text(ratios: Sequence[float]) -> str:
    """Ratios as percentages of their sum, such as ``"67%/33%"``."""
    return "/".join(f"{r / sum(ratios):.0%}" for r in ratios)


def table_row(cells: Sequence[object], widths: Sequence[int]) -> str:
    """One line of a plain-text table: the first cell left-aligned, the others right-aligned.

    Args:
        cells: the cells, already formatted (anything else is turned into text with ``str``).
        widths: the width of each column; a longer cell widens its column on this line.

    Returns:
        The line, without a newline.
    """
    first, *rest = (str(c) for c in cells)
    return f"{first:<{widths[0]}}" + "".join(f"{c:>{w}}" for c, w in zip(rest, widths[1:]))
