"""The optimizer's state in parts on TensorFlow: its storage and its collective (the rest is
:mod:`multigpu.backend.sharding`).

A state variable this rank does not own keeps its Keras shape over a
``tf.Variable`` of no elements.  The update runs inside the step's
``tf.function``, so the new weights reach every rank there: a
``tf.numpy_function`` (ordered after the owned update and before the
constraints, as TensorFlow orders stateful operations) sums one vector per
dtype that holds this rank's owned values and zeros elsewhere, through the
engine (shared memory between ranks of one machine, else gloo).  With
``jit_compile`` the update runs without XLA, which cannot call into Python.
With gradient accumulation the weights are shared at every step (unchanged
where no update ran), since a traced step cannot ask Python which step
updates.  A device's memory is known where it was given (``cpu:0/8GiB``);
elsewhere the parts are equal.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from multigpu._keras import compat as _compat
from multigpu.backend.sharding import Shard
from multigpu.backend.sharding import ShardedOptimizers as _Neutral
from multigpu.planning.partition import memory_weights

__all__ = ["ShardedOptimizers"]


class ShardedOptimizers(_Neutral):
    """The optimizers in parts of one parallel model on TensorFlow.

    Args:
        comm: the run's collectives.
        ledger: the model's ledger.
        weights: each rank's share of the state (default: the devices' given memory; equal where unknown).
    """

    traced = True

    def __init__(self, comm, ledger, weights=None) -> None:
        memory = [None if d.memory is None else int(d.memory) for d in comm.runtime.devices]
        super().__init__(comm, ledger, weights if weights is not None else memory_weights(memory))

    def size(self, variable) -> int:
        return int(np.prod(variable.value.shape))

    def empty(self, reference):
        return tf.zeros([0], dtype=reference.dtype)

    def resize(self, slot, variable, whole: bool) -> None:
        shape = tuple(slot.shape) if whole else (0,)
        _compat.set_variable_storage(slot, tf.Variable(tf.zeros(shape, dtype=slot.dtype), trainable=False,
                                                       name=slot.name))

    def sum_owned(self, pairs: list[tuple[object, object]], shard: Shard, tag: int, what: str) -> None:
        by_dtype: dict[str, list[tuple[object, bool]]] = {}
        for variable, model_variable in pairs:
            by_dtype.setdefault(variable.dtype, []).append((variable, id(model_variable) in shard.mine))
        for dtype, group in by_dtype.items():
            sizes = [int(np.prod(v.shape)) for v, _ in group]
            vector = tf.concat([tf.zeros([0], dtype)] + [tf.reshape(v.value, [-1]) if mine else tf.zeros([n], dtype)
                                                         for (v, mine), n in zip(group, sizes)], 0)
            summed = tf.numpy_function(lambda values, what=what: self.comm.reduce(values, f"sharing {what}"),
                                       [vector], vector.dtype, stateful=True)
            summed.set_shape(vector.shape)
            for (variable, mine), part in zip(group, tf.split(summed, sizes) if sizes else []):
                if not mine:
                    variable.assign(tf.reshape(part, variable.shape))
