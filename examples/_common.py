"""Helpers shared by the examples: command-line arguments, runs in fresh processes, timing and tables.

The examples are run as ``python examples/NAME.py``, which puts this folder on ``sys.path``, so
they import it as ``from _common import ...``.  Everything here is plumbing around an example;
the model, the ``multigpu.parallelize`` call and the training stay in each example.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gzip
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")  # as in every example, should this module be imported first

import keras
import numpy as np

import multigpu

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


# -------------------------------------------------------------------- devices
@dataclass(frozen=True)
class PlannedDevice:
    """A device of the full run, as a driver plans its runs.

    Attributes:
        spec: the device as ``--devices`` and ``parallelize`` take it, e.g. ``"cpu:1@0.5"``.
        cores: the CPU cores it has in the run on all the devices (none for a GPU).
    """

    spec: str
    cores: tuple[int, ...] = ()


def plan_devices(devices: str | Sequence[str]) -> list[PlannedDevice]:
    """``--devices`` as the devices of the full run, each CPU device with its block of this process's cores.

    ``"auto"`` is what ``parallelize`` takes it for: every GPU that :func:`multigpu.list_devices` lists, and on a
    machine without one, one CPU device per core, at most 8.  The CPU devices share the cores in contiguous blocks
    of nearly equal size, in list order, as ``parallelize`` binds them.
    """
    if isinstance(devices, str) and devices == "auto":
        found = multigpu.list_devices()
        specs = [d.spec for d in found if d.is_cuda] or [d.spec for d in found][:8]
    else:
        specs = [devices] if isinstance(devices, str) else list(devices)
    cores = sorted(os.sched_getaffinity(0))
    cpus = [i for i, spec in enumerate(specs) if spec.strip().lower().startswith("cpu")]
    planned = [PlannedDevice(spec) for spec in specs]
    for k, i in enumerate(cpus):
        block = cores[k * len(cores) // len(cpus) : (k + 1) * len(cores) // len(cpus)] or [cores[k % len(cores)]]
        planned[i] = PlannedDevice(specs[i], tuple(block))
    return planned


# ------------------------------------------------------------ fresh processes
# What a run sets for its ranks (multigpu's own, and torchrun's): a process that starts a run of its own drops them.
RUN_VARS = ("MULTIGPU_RANK", "MULTIGPU_WORLD_SIZE", "MULTIGPU_MASTER_ADDR", "MULTIGPU_MASTER_PORT",
            "MULTIGPU_STORE_FD", "MULTIGPU_DEVICES", "MULTIGPU_RATIOS", "MULTIGPU_SUPERVISOR_PID",
            "MULTIGPU_RUN_DIR", "MULTIGPU_TIMEOUT", "MULTIGPU_LAUNCH_DIR", "MULTIGPU_GIVEN",
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def independent_env() -> dict[str, str]:
    """This environment without the variables that make a process a rank of a run.

    Returns:
        A copy of ``os.environ`` for a process that starts a run of its own, on this process's Keras backend.
    """
    drop = set(RUN_VARS)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["KERAS_BACKEND"] = keras.backend.backend()
    return env


def die_with_parent() -> None:
    """Asks Linux to send this process SIGTERM when its parent exits (``prctl(PR_SET_PDEATHSIG)``)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


def run_worker(script: str, devices: Sequence[PlannedDevice], options: Sequence[str], *,
               ratios: str | Sequence[float] | None = None, result_flag: str = "--worker",
               prefix: str = "example-") -> dict:
    """Runs ``script`` on ``devices`` in fresh processes and returns the JSON result it writes.

    The command is ``python SCRIPT --devices SPECS [--ratios R] OPTIONS RESULT_FLAG PATH``; the
    script trains (starting its other ranks itself, as ``parallelize`` does) and writes its
    result to ``PATH`` as JSON.  The process is bound to the CPU cores the devices have (so that
    fewer devices than in the full run keep the cores they have there) and dies with this one.

    Args:
        script: the example's file, usually ``__file__``.
        devices: the devices to train on, with their cores (:func:`plan_devices`).
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


# Where Fashion-MNIST's four IDX files are looked for: Debian's dataset-fashion-mnist package, then Keras's cache.
FASHION_MNIST = ["/usr/share/datasets/fashion-mnist", os.path.expanduser("~/.keras/datasets/fashion-mnist")]


def read_fashion_mnist() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None:
    """``(x_train, y_train), (x_test, y_test)`` as uint8 arrays from the first folder of ``FASHION_MNIST`` that holds
    the four IDX files (gzipped or not), or None."""
    stems = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    for folder in FASHION_MNIST:
        paths = [next((p for p in (f"{folder}/{stem}.gz", f"{folder}/{stem}") if os.path.isfile(p)), None)
                 for stem in stems]
        if None in paths:
            continue
        arrays = []
        for path in paths:
            with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
                data = f.read()
            ndim = data[3]  # an IDX file: 0, 0, the type (8: uint8), the number of dimensions, then each size
            shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
            arrays.append(np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape))
        x_train, y_train, x_test, y_test = arrays
        return (x_train, y_train), (x_test, y_test)
    return None
