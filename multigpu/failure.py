"""A rank's failure state and its notes to the supervisor: a leaf every layer may import.

A rank that cannot go on calls :func:`fail` (from the backends' collectives,
the input readers, the run's start): it leaves the reason in the run's folder
for the supervisor (:func:`write_note`), prints it naming the rank and device,
and exits at once without touching the process group again.  Uncaught
exceptions (the main thread's and other threads') mark the rank failed too,
so that its exit skips waiting for the others.  :mod:`multigpu.runtime` tells
this module who the rank is (:func:`identify`) and installs the hooks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from multigpu import env
from multigpu.log import logger as log

__all__ = ["fail", "failed", "identify", "note_failure", "note_thread_failure", "read_failure", "read_note",
           "timeout_hint", "write_failure", "write_note"]

_FAILED = False
_WHO: tuple[int, str] | None = None  # (rank, device label) once the run has started


def identify(rank: int, label: str) -> None:
    """Names this rank in failure messages and notes."""
    global _WHO
    _WHO = (rank, label)


def fail(reason: str) -> None:
    """Ends this rank at once because the run cannot go on (never returns).

    Prints the reason naming the rank and device, tells the supervisor, and
    exits without touching the process group again.
    """
    global _FAILED
    _FAILED = True
    who = f"rank {_WHO[0]} ({_WHO[1]})" if _WHO else "multigpu"
    write_failure(_WHO[0] if _WHO else 0, reason)
    try:
        log.error(f"{who}: {reason}")
        sys.stdout.flush()
    finally:
        os._exit(1)


def failed() -> bool:
    """True once this rank has failed (its exit skips waiting for the others)."""
    return _FAILED


def note_failure(hook):
    """``sys.excepthook`` that marks the rank failed and tells the supervisor, then calls ``hook``."""
    def excepthook(exc_type, exc, tb):
        global _FAILED
        _FAILED = True
        if _WHO is not None:
            write_failure(_WHO[0], f"{exc_type.__name__}: {exc}")
        hook(exc_type, exc, tb)
    return excepthook


def note_thread_failure(hook):
    """``threading.excepthook`` that marks the rank failed (a thread's ``SystemExit`` aside), then calls ``hook``."""
    def excepthook(args):
        global _FAILED
        if args.exc_type is not SystemExit:
            _FAILED = True
        hook(args)
    return excepthook


def write_note(rank: int, kind: str, text: str) -> None:
    """Leaves ``text`` in the run's folder for the supervisor and the other ranks (no-op outside a run)."""
    run_dir = env.get(env.RUN_DIR)
    if not run_dir:
        return
    path = Path(run_dir) / f"rank{rank}.{kind}"
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:  # pragma: no cover - the folder is gone: the supervisor is too
        pass


def read_note(run_dir: str | os.PathLike | None, rank: int, kind: str) -> str | None:
    """What rank ``rank`` left under ``kind``, or None."""
    if not run_dir:
        return None
    try:
        return (Path(run_dir) / f"rank{rank}.{kind}").read_text().strip() or None
    except OSError:
        return None


def write_failure(rank: int, reason: str) -> None:
    """Tells the supervisor why this rank fails."""
    write_note(rank, "failure", reason)


def read_failure(run_dir: str | os.PathLike | None, rank: int) -> str | None:
    """The reason rank ``rank`` gave for failing, or None."""
    return read_note(run_dir, rank, "failure")


def timeout_hint(seconds: float) -> str:
    """What follows a collective's timeout: its commonest cause, the fix, and how to wait longer."""
    return ("\nCommonest cause: a call every rank must make was made on some ranks only, e.g. under "
            "`if multigpu.rank() == 0:` (Keras's `model.save`, `save_weights`, `evaluate`, `predict`, or a "
            "`ModelCheckpoint` callback given to one rank's fit; with shard='weights' any call of the model, whose "
            "layers gather their weights, and `get_weights`), so the other ranks never reach it. Fix: make the "
            "call on every rank; multigpu writes files from rank 0 only. If a rank is only slow (loading data, a "
            f"long first step), give it longer than {seconds:g} s: `multigpu.parallelize(model, timeout=SECONDS)` "
            "or `multigpu run --timeout SECONDS`.")
