"""Saving a parallel model: once (rank 0), atomically, as a plain Keras file.

The file is written to a temporary name next to the target and renamed over
it, so a crash never leaves a half-written file in place of a good one, and a
process that never imports multigpu loads it with ``keras.saving.load_model``.
"""

from __future__ import annotations

import os
import shutil
import weakref
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_save", "route_public_saving"]


def atomic_save(write: Callable, filepath, rank: int, overwrite: bool = True, **kwargs):
    """Calls ``write(path, overwrite=..., **kwargs)`` on rank 0 into a temporary file, then renames it.

    Args:
        write: Keras's own ``save``, ``save_weights`` or ``export`` of the model (a file or a folder).
        filepath: the target.
        rank: this rank's place after the writer (0: this rank writes; the others write nothing).
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
        if tmp.is_dir() and path.is_dir():  # a SavedModel (``export``): the old folder goes just before
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()
    return result


_ROUTED: dict = {}  # while parallel models live: Keras's own functions, and how many models hold the route


def route_public_saving(model, is_parallel: Callable[[object], bool]) -> weakref.finalize:
    """Makes ``keras.saving.save_model`` and ``keras.saving.save_weights`` (also ``keras.models.save_model``)
    of a parallel model go through the model's own ``save``/``save_weights``: rank 0 writes, atomically, and
    every rank waits for the file.  Keras's functions write directly, so without this every rank would
    write the same file at once.  Other models are passed to Keras's functions unchanged.

    The route lasts as long as some parallel model does: when the last one is collected (or made plain
    again: call the returned finalizer), Keras's own functions are put back.
    """
    import keras

    if not _ROUTED:
        original_model, original_weights = keras.saving.save_model, keras.saving.save_weights

        def save_model(model, filepath, overwrite=True, zipped=None, **kwargs):
            extra = {} if zipped is None else {"zipped": zipped}
            if is_parallel(model):
                return model.save(filepath, overwrite=overwrite, **extra, **kwargs)
            return original_model(model, filepath, overwrite=overwrite, **extra, **kwargs)

        def save_weights(model, filepath, overwrite=True, **kwargs):
            if is_parallel(model):
                return model.save_weights(filepath, overwrite=overwrite, **kwargs)
            return original_weights(model, filepath, overwrite=overwrite, **kwargs)

        for fn, original in ((save_model, original_model), (save_weights, original_weights)):
            fn.__doc__ = original.__doc__
        models_too = getattr(keras.models, "save_model", None) is original_model
        _ROUTED.update(model=original_model, weights=original_weights, models_too=models_too, holders=0)
        keras.saving.save_model = save_model
        keras.saving.save_weights = save_weights
        if models_too:
            keras.models.save_model = save_model
    _ROUTED["holders"] += 1
    return weakref.finalize(model, _release)


def _release() -> None:
    """One parallel model fewer; the last one puts Keras's own functions back."""
    if not _ROUTED:
        return
    _ROUTED["holders"] -= 1
    if _ROUTED["holders"] > 0:
        return
    import keras

    keras.saving.save_model = _ROUTED["model"]
    keras.saving.save_weights = _ROUTED["weights"]
    if _ROUTED["models_too"]:
        keras.models.save_model = _ROUTED["model"]
    _ROUTED.clear()
