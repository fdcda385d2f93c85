"""``multigpu.launch``: runs a function once per device, from a notebook, an IPython shell or a script.

A notebook cannot be run again as a program, so the function travels instead:
``launch`` pickles it with its arguments (cloudpickle: a function defined in
the notebook travels by value, with the globals it uses), and the run's
:class:`~multigpu.runtime.supervisor.Supervisor` starts one fresh Python
process per device that unpickles and calls it, with the variables of a
launched rank set, so that ``parallelize`` inside the function joins the run
as under ``multigpu run``.  Fresh processes (never a fork of the kernel) let
each rank choose its Keras backend, join ``jax.distributed`` before its first
computation and use CUDA whatever the kernel did before.

The ranks' output reaches the caller's ``sys.stdout`` (the cell) as it is
printed: rank 0's as it is, another rank's prefixed by its rank, and a line
that several ranks print (but for its numbers) once.  Rank 0's return value comes
back pickled.  A rank's exception raises :class:`RankError` in the caller with
the rank, its device and its traceback; an interrupt (the notebook's stop
button) stops every rank and raises ``KeyboardInterrupt``; the ranks die with
the kernel.
"""

from __future__ import annotations

import pickle
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from multigpu import env
from multigpu.devices import Device, assign_cores, parse_devices
from multigpu.runtime.processes import run_folder

__all__ = ["RankError", "launch"]

_DIGITS = re.compile(r"\d+")
RESULT = "result.pkl"
PAYLOAD = "payload.pkl"


class RankError(RuntimeError):
    """A rank of a :func:`launch` failed; the message names it and holds its traceback.

    Attributes:
        rank: the rank that failed.
        device: its device's label.
        traceback: the rank's traceback as text ("" when the rank said none).
    """

    def __init__(self, message: str, rank: int, device: str, traceback: str) -> None:
        super().__init__(message)
        self.rank, self.device, self.traceback = rank, device, traceback


def _dumps(obj, what: str) -> bytes:
    try:
        import cloudpickle
    except ImportError as exc:  # pragma: no cover - a dependency of multigpu
        raise ImportError("multigpu.launch needs cloudpickle (pip install cloudpickle)") from exc
    try:
        return cloudpickle.dumps(obj)
    except Exception as exc:
        raise TypeError(f"multigpu.launch: {what} must be picklable (it travels to every rank's process). "
                        f"Received: {exc}") from exc


def _check(fn, options: dict) -> None:
    if not callable(fn):
        raise TypeError(f"multigpu.launch takes a function to run on every device. Received: {fn!r:.100}")
    allowed = ("timeout", "env")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"multigpu.launch got unexpected keyword argument(s) {unknown}; it takes devices, ratios, "
                        f"{', '.join(allowed)} (pass the function's own arguments positionally). Received: "
                        f"{', '.join(f'{k}={options[k]!r:.40}' for k in unknown)}")


class _Output:
    """The ranks' output, forwarded line by line to the caller's ``sys.stdout`` from the caller's thread.

    Rank 0's lines go out as they come.  Another rank's line waits ``HOLD``
    seconds and goes out prefixed by its rank unless a rank printed the same
    line (but for its numbers) by then: a warning every rank gives appears once.
    """

    HOLD = 1.0

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.seen: set[str] = set()
        self.held: list[tuple[float, int, str, str]] = []
        self.threads = [threading.Thread(target=self._read, args=(r, p.stdout), daemon=True)
                        for r, p in enumerate(procs)]
        for t in self.threads:
            t.start()

    def _read(self, rank: int, stream) -> None:
        for line in iter(stream.readline, b""):
            self.queue.put((rank, line.decode(errors="replace")))
        stream.close()

    def flush(self, wait: float = 0.0) -> None:
        """Writes what the ranks printed so far; with ``wait``, waits up to that long for their last lines
        and writes every held line."""
        deadline = time.monotonic() + wait
        wrote = False
        while True:
            try:
                rank, line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()) if wait else 0.0)
            except queue.Empty:
                if not wait or time.monotonic() >= deadline or not any(t.is_alive() for t in self.threads):
                    break
                continue
            text = _DIGITS.sub("#", line.rstrip("\n"))  # "rank 1 is connected" is rank 0's line again
            if rank == 0:
                sys.stdout.write(line)
                self.seen.add(text)
                wrote = True
            elif text.strip():
                self.held.append((time.monotonic() + self.HOLD, rank, line, text))
        now = time.monotonic()
        keep = []
        for due, rank, line, text in self.held:
            if due > now and not wait:
                keep.append((due, rank, line, text))
            elif text not in self.seen:
                sys.stdout.write(f"[rank {rank}] {line}")
                self.seen.add(text)
                wrote = True
        self.held = keep
        if wrote:  # a kernel's flush wakes its output thread: only when there is something to send
            sys.stdout.flush()


def launch(fn: Callable[..., Any], *args: Any, devices: str | Sequence = "auto",
           ratios: str | Sequence[float] | None = None, **options: Any) -> Any:
    """Runs ``fn(*args)`` once per device; returns rank 0's return value.

    Inside ``fn``, ``multigpu.parallelize(model)`` joins the run, with the
    devices, ratios and timeout given here: they win over those
    ``parallelize`` is given, as ``multigpu run``'s command line does, and
    rank 0 says so in one line where they differ.  Works from a Jupyter or Colab cell, an
    IPython shell and a script alike.

    ``fn``, its arguments and its return value travel between processes with
    cloudpickle: a function defined in the notebook is sent with the globals
    it uses (data arrays included), and modules it uses are imported again in
    each rank.  Return something plain (``history.history``,
    ``model.get_weights()``, numbers), not the model or the History object.

    Args:
        fn: the training function.
        *args: its arguments.
        devices: as for ``parallelize`` (``"auto"``: every GPU, or one CPU
            device per core up to 8); devices of :func:`multigpu.list_devices`
            keep their cores (``devices=multigpu.list_devices()[:1]`` is one
            core, where ``"cpu:0"`` alone takes every core).
        ratios: as for ``parallelize`` (``None``: as ``parallelize`` is told,
            ``"auto"``: measured).
        **options: ``timeout`` (seconds a collective may wait, default 60);
            ``env`` (more environment variables for the ranks).

    Returns:
        What ``fn`` returned on rank 0.

    Raises:
        RankError: when a rank fails: names the rank and its device, with its traceback.
        KeyboardInterrupt: on an interrupt; every rank is stopped first.

    Example:

    ```python
    def train(epochs):
        model = multigpu.parallelize(build_model())
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model.fit(x, y, batch_size=256, epochs=epochs).history

    history = multigpu.launch(train, 3, devices=["cpu:0", "cpu:1"], ratios=[3, 1])
    ```
    """
    from multigpu.runtime.runtime import DEFAULT_TIMEOUT
    from multigpu.runtime.supervisor import Supervisor

    _check(fn, options)
    given = list(devices) if isinstance(devices, (list, tuple)) else [devices]
    # Devices of multigpu.list_devices() name their cores: the run stays on those (one core for one CPU device).
    cores = sorted({c for d in given for c in d.cores}) if all(
        isinstance(d, Device) and (d.cores or d.is_cuda) for d in given) else None
    parsed = assign_cores(parse_devices(devices), cores, warn=True)
    timeout = float(options.get("timeout") or DEFAULT_TIMEOUT)
    text = None if ratios is None else (ratios if isinstance(ratios, str) else ",".join(str(r) for r in ratios))
    payload = _dumps((fn, args), "the function and its arguments")
    folder = run_folder("launch")
    try:
        (Path(folder) / PAYLOAD).write_bytes(payload)
        command = [sys.executable, "-m", "multigpu.runtime.rank_entry", "call", str(Path(folder) / PAYLOAD)]
        # what launch was given wins over parallelize's arguments (env.fallback), as multigpu run's command line
        named = [env.DEVICES, *([env.RATIOS] if text is not None else []),
                 *([env.TIMEOUT] if options.get("timeout") else [])]
        extra = {"PYTHONUNBUFFERED": "1", env.LAUNCH_DIR: folder, env.GIVEN: ",".join(named),
                 **(options.get("env") or {})}
        group = Supervisor(command, parsed, timeout, ratios=text, env_extra=extra, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, cores=cores)
        group.start()
        output = _Output(group.procs)
        try:
            failure = _wait(group, output)
        except BaseException:
            group.stop(grace=2.0)
            output.flush(wait=1.0)
            raise
        output.flush(wait=2.0)
        if failure is not None:
            error = _rank_error(group, folder, *failure)
            group.stop(grace=2.0)
            raise error
        group.stop(grace=2.0)
        result = Path(folder) / RESULT
        return pickle.loads(result.read_bytes()) if result.exists() else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait(group, output: _Output) -> tuple[int, int] | None:
    while True:
        output.flush()
        code, rank = group.poll()
        if code is not None:
            return None if rank is None else (code, rank)
        time.sleep(0.1)


def _rank_error(group, folder: str, code: int, rank: int) -> RankError:
    from multigpu.failure import read_note

    described = group.describe_failure(code, rank)
    tb = read_note(folder, rank, "traceback") or ""
    message = f"multigpu.launch: {described}"
    if tb:
        message += f"\n\nTraceback of rank {rank}:\n{tb}"
    return RankError(message, rank, group.devices[rank].label, tb)
