"""Models whose class brings its own ``fit``/``evaluate``/``predict`` (keras-hub's tasks).

A keras-hub ``Task`` (through ``PipelineModel``) overrides ``fit``,
``evaluate``, ``predict`` and the ``*_on_batch`` methods: each turns the
user's arguments into a dataset that batches them and runs the task's
preprocessing (tokenising, packing), then calls ``super().fit(x=dataset)``.
multigpu keeps that order.  The class's method runs first, with the user's
arguments, on every rank; the ``super()`` call it makes lands in multigpu's
loop (:mod:`multigpu.keras.loops`) instead of Keras's, which reads the
dataset once per machine and cuts each global batch by the shares.  So the
task's own preprocessing runs as it would on one device, once per global
batch, and no rank preprocesses another's rows.

``super()`` looks methods up on the class, so the hand-over is a method set
on ``keras.Model`` while the class's method runs: it serves this one model
and passes every other instance on to Keras's own method, and it is removed
when the call returns or raises (:func:`routed`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import keras

from multigpu._keras.model_parts import own_method

__all__ = ["ROUTED", "base_methods", "own_methods", "routed"]

ROUTED = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
_LOCK = threading.Lock()


def own_methods(model) -> dict[str, Callable]:
    """The methods of :data:`ROUTED` that the model's class defines over Keras's, bound to the model."""
    cls = type(model)
    return {name: method.__get__(model, cls) for name in ROUTED if (method := own_method(cls, name)) is not None}


def base_methods(model) -> dict[str, Callable]:
    """Keras's own methods of :data:`ROUTED` (those of ``keras.Model``), bound to the model."""
    cls = type(model)
    return {name: getattr(keras.Model, name).__get__(model, cls) for name in ROUTED}


@contextlib.contextmanager
def routed(model, name: str, target: Callable) -> Iterator[None]:
    """While open, ``super().<name>(...)`` reaching ``keras.Model`` from ``model`` calls ``target`` instead.

    Every other instance still gets Keras's own method.  Nested routes (of
    other names, or of the same name) restore what they found.

    Args:
        model: the parallel model.
        name: one of :data:`ROUTED`.
        target: called with the arguments the class's method passed on.
    """
    with _LOCK:
        had = name in vars(keras.Model)
        found = vars(keras.Model).get(name)
        keras_method = getattr(keras.Model, name)

        def dispatch(self, *args, **kwargs):
            if self is model:
                return target(*args, **kwargs)
            return keras_method(self, *args, **kwargs)

        dispatch.__name__ = dispatch.__qualname__ = name
        dispatch.__doc__ = keras_method.__doc__
        setattr(keras.Model, name, dispatch)
    try:
        yield
    finally:
        with _LOCK:
            if had:
                setattr(keras.Model, name, found)
            else:
                delattr(keras.Model, name)
