"""What every backend's steps read of a model and its batches (no Keras internals, no backend).

* :func:`batch_rows`: the rows of a batch's inputs;
* :func:`own_method`: a model class's override of a Keras ``Model`` method;
* :func:`optimizers_of`: the optimizers a model's steps may call (``model.optimizer`` and any other
  optimizer attribute, as a GAN has);
* :func:`batchnorm_layers`: every ``BatchNormalization`` layer, nested ones included;
* :func:`batchnorm_statistics`: their moving statistics, once each.
"""

from __future__ import annotations

import keras

from multigpu.keras import _compat

__all__ = ["batch_rows", "batchnorm_layers", "batchnorm_statistics", "optimizers_of", "own_method"]


def batch_rows(x) -> int:
    """Rows of the first input array of ``x`` (0 when it has none)."""
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
