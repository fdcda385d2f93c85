"""The backend seam: one module per Keras backend, chosen once, as Keras does.

Everything above this package (planning, balancing, the supervisor, the Keras
integration, the command line) is backend-neutral.  A backend module gives:

* ``bind(device)``: threads and accelerator of this process;
* ``join(runtime)`` / ``leave(failed)``: enter and leave the run's group;
* ``Comm(runtime)``: the collectives (every error fatal);
* ``Steps(parallel_model)``: the training, test and predict steps, a
  :class:`multigpu.backend.steps.StepsCore` (its docstring is the contract;
  ``multigpu.parallelize`` hands the class to
  :class:`multigpu.keras.parallel.ParallelModel`).
"""

from __future__ import annotations

from types import ModuleType

from multigpu import env

__all__ = ["SUPPORTED", "get", "name"]

SUPPORTED = ("torch", "jax")


def name() -> str:
    """The Keras backend in use (``keras.backend.backend()`` once Keras is imported)."""
    return env.keras_backend()


def check() -> str:
    """The backend name, or a clear error when multigpu cannot run on it.

    Raises:
        RuntimeError: naming the backend found and the ones supported.
    """
    current = name()
    if current not in SUPPORTED:
        raise RuntimeError(
            f"multigpu runs on Keras's {' or '.join(SUPPORTED)} backend. Set KERAS_BACKEND={SUPPORTED[0]} (or "
            f"{SUPPORTED[1]}) before Keras is imported (e.g. `KERAS_BACKEND={SUPPORTED[0]} python train.py`). "
            f"Received: backend={current!r}"
        )
    return current


def get() -> ModuleType:
    """The module of the backend in use."""
    current = check()
    if current == "torch":
        from multigpu.backend import torch as module
    else:
        from multigpu.backend import jax as module
    return module
