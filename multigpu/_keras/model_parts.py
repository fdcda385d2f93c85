"""What every backend's steps read of a model and its batches (no Keras internals, no backend).

* :func:`batch_rows`: the rows of a batch's inputs;
* :func:`own_method`: a model class's override of a Keras ``Model`` method;
* :func:`optimizers_of`: the optimizers a model's steps may call (``model.optimizer`` and any other
  optimizer attribute, as a GAN has);
* :func:`build_optimizer`: builds an optimizer on the variables of its first update, as its ``apply`` would;
* :func:`optimizer_slots`: how many values an optimizer keeps per weight (Adam: 2);
* :func:`batchnorm_layers`: every ``BatchNormalization`` layer, nested ones included;
* :func:`batchnorm_statistics`: their moving statistics, once each;
* :func:`use_global_batchnorm`: every such layer trains with statistics a backend computes over ranks;
* :func:`results_with_states`: Keras's metric results with every state replaced (by its sum over ranks).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import keras
import numpy as np

from multigpu._keras import compat as _compat

__all__ = ["batch_rows", "batchnorm_layers", "batchnorm_statistics", "build_optimizer", "optimizer_slots",
           "optimizers_of",
           "own_method", "results_with_states", "use_global_batchnorm"]


def batch_rows(x) -> int:
    """Rows of the first input array of ``x`` (0 when it has none)."""
    if hasattr(x, "shape") and len(x.shape):
        return int(x.shape[0])  # one array, the common case, at every step
    for leaf in keras.tree.flatten(x):
        if leaf is not None:
            return int(leaf.shape[0])
    return 0


def own_method(cls, name: str):
    """The class's ``name`` if it overrides ``keras.Model``'s, else None."""
    method = getattr(cls, name)
    return None if method is getattr(keras.Model, name) else method


def optimizers_of(model) -> list:
    """``model.optimizer`` first, then every other optimizer among the model's attributes."""
    found = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    for value in vars(model).values():
        if isinstance(value, keras.optimizers.Optimizer) and value not in found:
            found.append(value)
    return found


def build_optimizer(optimizer, variables) -> None:
    """Builds ``optimizer`` on ``variables`` (the ones its first ``apply`` updates) the way that ``apply``
    would, in the optimizer's name scope; nothing when it is built."""
    if optimizer.built:
        return
    with keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(list(variables))
    optimizer.built = True


def optimizer_slots(optimizer, unknown: float | None = 0.0) -> float | None:
    """How many values ``optimizer`` keeps per weight it updates (Adam: 2; SGD with momentum: 1; an EMA and
    gradient accumulators count too; a ``LossScaleOptimizer``: its inner one's), read from a copy built on a
    small matrix (its state variables of that matrix's shape are counted: a factored state, Adafactor's, counts
    as less than one); ``unknown`` where the copy cannot be made (an optimizer that does not rebuild from its
    config)."""
    shape = (31, 37)
    optimizer = getattr(optimizer, "inner_optimizer", None) or optimizer  # a loss scale's own state is scalars
    try:
        copy = type(optimizer).from_config(optimizer.get_config())
        copy.build([keras.Variable(np.zeros(shape, "float32"))])
    except Exception:  # a custom optimizer whose config does not rebuild it
        return unknown
    return float(sum(1 for v in copy.variables if tuple(v.shape) == shape))


def batchnorm_layers(model) -> list:
    """Every ``BatchNormalization`` layer of ``model``, nested ones included."""
    return [layer for layer in _compat.flatten_layers(model) if isinstance(layer, keras.layers.BatchNormalization)]


def batchnorm_statistics(model) -> list:
    """The moving mean and variance variables of every ``BatchNormalization`` layer, once each, in layer order."""
    seen, variables = set(), []
    for layer in batchnorm_layers(model):
        for v in layer.non_trainable_variables:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
    return variables


def use_global_batchnorm(model, global_moments: Callable[[object, int], Callable], ledger) -> int:
    """Makes every ``BatchNormalization`` layer of ``model`` train with the global batch's statistics.

    Args:
        model: the model.
        global_moments: ``(layer, index) -> moments``, where ``moments(inputs)`` returns the mean and
            variance over every rank's rows (the backend's collective); ``index`` is the layer's place
            in :func:`batchnorm_layers`, the same on every rank.
        ledger: the model's :class:`~multigpu._keras.ledger.Ledger`.

    A layer called with a mask, or with ``renorm``, keeps its own statistics (with a warning, once).

    Returns:
        The number of layers changed.
    """
    layers = batchnorm_layers(model)
    for index, layer in enumerate(layers):
        _compat.replace_batchnorm_moments(layer, _or_local(layer, global_moments(layer, index)), ledger)
    return len(layers)


def _or_local(layer, moments):
    local_moments = _compat.batchnorm_moments(layer)
    warned = []

    def either(inputs, mask):
        if mask is None and not getattr(layer, "renorm", False):
            return moments(inputs)
        if not warned:
            warned.append(True)
            warnings.warn(f"sync_batchnorm: layer {layer.name!r} has a mask or renorm; it uses each device's own "
                          "statistics.", stacklevel=2)
        return local_moments(inputs, mask)

    return either


def results_with_states(model, metric_refs: list, values: list) -> dict:
    """Keras's metric results of ``model`` with each of ``metric_refs`` replaced by its value in ``values``
    (traced or eager, on any backend: the states summed over ranks become the global results)."""
    with keras.StatelessScope(state_mapping=list(zip(metric_refs, values))):
        out = {}
        for metric in model.metrics:
            value = metric.result()
            out.update(value if isinstance(value, dict) else {metric.name: value})
    return out
