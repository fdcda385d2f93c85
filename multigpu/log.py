"""multigpu's messages, through Python's ``logging``: the logger ``"multigpu"``.

Every message names its source (``multigpu: ...``, or the command, as in
``multigpu run: ...``); notices go to standard output (a notebook's cell
shows them as a ``print`` would), warnings and errors to standard error.  Quieter or
more verbose, as with any library::

    logging.getLogger("multigpu").setLevel(logging.WARNING)   # errors and warnings only

or, for every rank of a run, ``MULTIGPU_LOG_LEVEL=warning`` (``multigpu run
--log-level warning``).

The logger propagates as any library's does: once the program configures
logging (``logging.basicConfig(...)``, a handler on the root logger),
multigpu's messages go to its handlers, formatted as it says, and multigpu
prints nothing itself.  Until then multigpu prints them as above.  The
``multigpu`` command always prints them (it is the program).
"""

from __future__ import annotations

import logging
import sys

from multigpu import env

__all__ = ["LEVELS", "logger", "print_always", "set_level"]

LEVELS = ("debug", "info", "warning", "error")
logger = logging.getLogger("multigpu")


class _Handler(logging.Handler):
    """Writes to the ``sys.stdout`` or ``sys.stderr`` of the moment (a notebook's cell, a test's capture), while
    the program has not configured logging (then the root logger's handlers take the record)."""

    always = False  # the multigpu command: print whatever the root logger has

    def emit(self, record: logging.LogRecord) -> None:
        if not self.always and logging.getLogger().handlers:
            return
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # pragma: no cover - a closed stream at exit
            self.handleError(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{getattr(record, 'source', 'multigpu')}: {record.getMessage()}"


def print_always() -> None:
    """multigpu's own output: the ``multigpu`` command prints its messages whatever logging is configured."""
    _Handler.always = True


def set_level(level: str | int) -> None:
    """Sets the level of multigpu's messages.

    Args:
        level: ``"debug"``, ``"info"`` (the default), ``"warning"`` or ``"error"``, or a ``logging`` level.

    Raises:
        ValueError: for another name.
    """
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise ValueError(f"the log level must be one of {', '.join(LEVELS)}. Received: {level!r}")
        level = level.upper()
    logger.setLevel(level)


if not logger.handlers:
    _handler = _Handler()
    _handler.setFormatter(_Formatter())
    logger.addHandler(_handler)
    set_level(env.get(env.LOG_LEVEL) or "info")
