"""The backend seam: one module per Keras backend, chosen once, as Keras does.

Everything above this package (planning, balancing, the supervisor, the Keras
integration, the command line) is backend-neutral.  A backend module gives:

* ``bind(device)``: threads and accelerator of this process;
* ``join(runtime)`` / ``leave(failed)``: enter and leave the run's group;
* ``Comm(runtime)``: the collectives (every error fatal), with the members
  and signatures :mod:`multigpu.backend.collectives` declares;
* ``Steps(parallel_model)``: the training, test and predict steps, a
  :class:`multigpu.backend.steps.StepsCore` (its docstring is the contract;
  ``multigpu.parallelize`` hands the class to
  :class:`multigpu.keras.parallel.ParallelModel`);
* ``FACTS``: its policy and hardware facts, a :class:`multigpu.backend.facts.Facts`
  (the local-batch grid, whether the share search opens with a scan, the
  16-bit formats it sends, its GPUs), which the layers above read instead of
  testing the backend's name.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from multigpu import env
from multigpu.backend.facts import Facts

__all__ = ["SUPPORTED", "facts", "get", "gpu_count", "name"]

SUPPORTED = ("torch", "jax", "tensorflow")


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
            f"multigpu runs on Keras's {', '.join(SUPPORTED[:-1])} or {SUPPORTED[-1]} backend. Set KERAS_BACKEND to "
            f"one of them before Keras is imported (e.g. `KERAS_BACKEND={SUPPORTED[0]} python train.py`). "
            f"Received: backend={current!r}"
        )
    return current


def lazy(package: str, **where: str):
    """A backend package's ``__getattr__``: each name imported from its module at first use, so that importing
    the package imports no framework: ``bind``, ``join`` and ``leave`` from its ``group`` module, the others
    where ``where`` says (``Steps="multigpu.backend.jax.step:JaxSteps"``)."""
    where = {**{n: f"{package}.group:{n}" for n in ("bind", "join", "leave")}, **where}

    def attribute(name: str):
        if name not in where:
            raise AttributeError(name)
        module, _, attr = where[name].partition(":")
        return getattr(importlib.import_module(module), attr)

    return attribute


def get() -> ModuleType:
    """The module of the backend in use (``multigpu.backend.<name>``)."""
    return importlib.import_module(f"{__name__}.{check()}")


def facts() -> Facts:
    """The facts of the backend in use, without importing its collectives or steps."""
    return importlib.import_module(f"{__name__}.{check()}.facts").FACTS


def gpu_count() -> int:
    """The GPUs the backend in use can run on (0 on a backend multigpu does not run on)."""
    return facts().gpu_count() if name() in SUPPORTED else 0
