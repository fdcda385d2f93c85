"""Warnings that point at the user's line, not at multigpu's."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_user"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_SAID: set[str] = set()


def warn_user(message: str, category: type[Warning] = UserWarning, *, once: bool = True) -> None:
    """Warns at the first frame outside multigpu (the user's call), at most once per message.

    Args:
        message: the warning.
        category: its class.
        once: skip a message already given in this process.
    """
    if once:
        if message in _SAID:
            return
        _SAID.add(message)
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame = frame.f_back
    if frame is None:  # pragma: no cover - called from multigpu only
        warnings.warn(message, category, stacklevel=2)
        return
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=frame.f_globals.setdefault(
                               "__warningregistry__", {}))
