"""Saving a parallel model: once (rank 0), atomically, as a plain Keras file.

The file is written to a temporary name next to the target and renamed over
it, so a crash never leaves a half-written file in place of a good one, and a
process that never imports multigpu loads it with ``keras.saving.load_model``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_save"]


def atomic_save(write: Callable, filepath, rank: int, overwrite: bool = True, **kwargs):
    """Calls ``write(path, overwrite=..., **kwargs)`` on rank 0 into a temporary file, then renames it.

    Args:
        write: Keras's own ``save`` or ``save_weights`` of the model.
        filepath: the target.
        rank: this rank; other ranks write nothing.
        overwrite: as in Keras (an existing file is left alone when False).
    """
    if rank != 0:
        return None
    path = Path(os.fspath(filepath))
    if not overwrite and path.exists():
        return write(filepath, overwrite=False, **kwargs)
    suffix = "".join(path.suffixes[-2:]) if path.name.endswith(".weights.h5") else path.suffix
    tmp = path.with_name(f".{path.name[: -len(suffix) or None]}.tmp{os.getpid()}{suffix}")
    try:
        result = write(tmp, overwrite=True, **kwargs)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return result
