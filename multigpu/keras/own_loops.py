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

``super()`` looks methods up along the class's MRO, so the hand-over is a
class: for a model class ``C``, the subclass ``C`` of ``(C, _HandOver)``
(made once per class, same name and module) puts :class:`_HandOver` between
the last of ``C``'s own classes and ``keras.Model``.  The parallel model
alone gets it (:func:`hand_over`, noted in its ledger, so that
``unparallelize`` gives the model its class back); :class:`_HandOver` sends
a ``super()`` call of this model to multigpu's loop, and any other instance
of the class on to Keras's own method.  No Keras class is changed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import keras

from multigpu._keras.model_parts import own_method

__all__ = ["ROUTED", "as_class", "base_methods", "hand_over", "own_methods"]

ROUTED = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
_TARGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {name: multigpu's loop}
_CLASSES: dict[type, type] = {}  # a model class -> its hand-over subclass


def own_methods(model) -> dict[str, Callable]:
    """The methods of :data:`ROUTED` that the model's class defines over Keras's, bound to the model."""
    cls = type(model)
    return {name: method.__get__(model, cls) for name in ROUTED if (method := own_method(cls, name)) is not None}


def base_methods(model) -> dict[str, Callable]:
    """Keras's own methods of :data:`ROUTED` (those of ``keras.Model``), bound to the model."""
    cls = type(model)
    return {name: getattr(keras.Model, name).__get__(model, cls) for name in ROUTED}


def _pass_on(name: str):
    keras_method = getattr(keras.Model, name)

    def method(self, *args, **kwargs):
        target = _TARGETS.get(self, {}).get(name)
        if target is None:  # another instance of the class (a clone, say): Keras's own
            return keras_method(self, *args, **kwargs)
        return target(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = keras_method.__doc__
    return method


class _HandOver(keras.Model):
    """Between a model class and ``keras.Model``: a parallel model's ``super().fit(...)`` reaches multigpu."""


for _name in ROUTED:
    setattr(_HandOver, _name, _pass_on(_name))


def hand_over(model, targets: dict[str, Callable], ledger) -> None:
    """Makes the ``super()`` calls of ``model``'s own methods (``targets``' names) reach ``targets``.

    Args:
        model: the parallel model, whose class defines some of :data:`ROUTED`.
        targets: multigpu's loop for each such name.
        ledger: the model's ledger, which notes the class it had.
    """
    if not targets:
        return
    cls = type(model)
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = _CLASSES[cls] = type(cls.__name__, (cls, _HandOver), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    _TARGETS[model] = dict(targets)
    ledger.set_class(model, sub)


@contextlib.contextmanager
def as_class(model, cls: type) -> Iterator[None]:
    """While open, ``model`` is of class ``cls`` (its own, for Keras's saving, which names the class it writes)."""
    now = type(model)
    if now is cls:
        yield
        return
    object.__setattr__(model, "__class__", cls)
    try:
        yield
    finally:
        object.__setattr__(model, "__class__", now)
