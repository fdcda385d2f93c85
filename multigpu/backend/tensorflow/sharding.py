"""The optimizer's state in parts on TensorFlow: its storage and its collective (the rest is
:mod:`multigpu.backend.sharding`).

A state variable this rank does not own keeps its Keras shape over a
``tf.Variable`` of no elements.  The update runs inside the step's
``tf.function``, so the new weights reach every rank there: a
``tf.numpy_function`` (ordered after the owned update and before the
constraints, as TensorFlow orders stateful operations) hands this rank's
owned values to the engine, each written where it belongs in one vector per
dtype (straight into the result on shared memory between ranks of one
machine; elsewhere a gloo sum with zeros where a rank does not own), and
only the others' values come back, one tensor per variable.  With
``jit_compile`` the update runs without XLA, which cannot call into Python.
With gradient accumulation the weights are shared at every step (unchanged
where no update ran), since a traced step cannot ask Python which step
updates.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from multigpu._keras import compat as _compat
from multigpu.backend.sharding import Shard
from multigpu.backend.sharding import ShardedOptimizers as _Neutral

__all__ = ["ShardedOptimizers"]


class ShardedOptimizers(_Neutral):
    """The optimizers in parts of one parallel model on TensorFlow (arguments: the neutral class's)."""

    traced = True

    def size(self, variable) -> int:
        return int(np.prod(variable.value.shape))

    def empty(self, reference):
        return tf.zeros([0], dtype=reference.dtype)

    def resize(self, slot, variable, whole: bool) -> None:
        shape = tuple(slot.shape) if whole else (0,)
        _compat.set_variable_storage(slot, tf.Variable(tf.zeros(shape, dtype=slot.dtype), trainable=False,
                                                       name=slot.name))

    def sum_owned(self, pairs: list[tuple[object, object]], shard: Shard, tag: int, what: str) -> None:
        if self.comm.alone:  # (traced for the one rank left, which owns every part: nothing to share)
            return
        by_dtype: dict[str, list[tuple[object, bool]]] = {}
        for variable, model_variable in pairs:
            by_dtype.setdefault(variable.dtype, []).append((variable, id(model_variable) in shard.mine))
        for dtype, group in by_dtype.items():
            sizes = [int(np.prod(v.shape)) for v, _ in group]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
            total = offsets[-1]
            where = [offsets[i] for i, (_, mine) in enumerate(group) if mine]
            others = [(offsets[i], n) for i, ((_, mine), n) in enumerate(zip(group, sizes)) if not mine]
            owned = [v.value for v, mine in group if mine]  # each handed over as it is, written where it belongs
            numpy_dtype = tf.as_dtype(dtype).as_numpy_dtype

            def exchange(*values, where=where, others=others, total=total, numpy=numpy_dtype):
                if numpy == np.float32:  # the same way on every rank, those that own none of it too
                    whole = self.comm.gather_parts(values, where, total, f"sharing {what}")
                else:  # a sum of vectors that are zero where a rank does not own
                    vector = np.zeros(total, numpy)
                    for start, v in zip(where, values):
                        vector[start : start + v.size] = v.reshape(-1)
                    whole = self.comm.reduce(vector, f"sharing {what}")
                # copies: TensorFlow may keep an array it is handed as it is, and the next sum writes over the result
                return [np.zeros(0, whole.dtype), *(whole[o : o + n].copy() for o, n in others)]

            dtypes = [tf.as_dtype(dtype)] * (len(others) + 1)
            parts = tf.numpy_function(exchange, owned, dtypes, stateful=True)[1:]
            for variable, value in zip([v for v, mine in group if not mine], parts):
                variable.assign(tf.reshape(value, variable.shape))
