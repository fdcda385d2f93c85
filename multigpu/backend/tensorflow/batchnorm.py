"""BatchNormalization over the global batch on TensorFlow (``sync_batchnorm=True``).

Every ``BatchNormalization`` layer's batch statistics are computed over the
whole global batch: each rank sums its rows and squared rows, and a
differentiable sum over ranks adds them up (a ``tf.numpy_function`` inside
the step's graph, with a gradient that sums the statistics' gradients over
ranks), so the forward pass equals one device's on the whole batch and so
does the backward pass.  TensorFlow orders the sums as it orders stateful
operations, so the ranks make them in the same order (a layer applied twice
makes two).  The step runs without XLA then.

The backward sum is exact when each rank's loss carries its share ``b_r /
B``: the built-in step weights its loss; for a ``train_step`` of the model's
own, whose gradients are weighted in ``optimizer.apply``, each rank sends its
statistics' gradient times its share and divides what comes back by it.  A
rank with no rows adds nothing.  While the shares are calibrated every rank
times itself alone and the sums are left out (:meth:`GlobalBatchNorm.alone`).
Keras's own ``synchronized=True`` needs a ``tf.distribute`` strategy.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import tensorflow as tf

from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import use_global_batchnorm

__all__ = ["GlobalBatchNorm"]


class GlobalBatchNorm:
    """The global statistics of a model's BatchNormalization layers.

    Args:
        model: the model (its layers are changed once, here).
        comm: the run's collectives.
        timing: the step timing (the sums count as waiting).
        ledger: the model's :class:`~multigpu._keras.ledger.Ledger`, which notes the layers' new ``_moments``.
    """

    def __init__(self, model, comm, timing, ledger) -> None:
        self.comm = comm
        self.timing = timing
        self._weight = 1.0  # this rank's share in the backward sum
        self._contributes = True  # this rank's rows count in the forward sum
        self._alone = False
        self.layers = use_global_batchnorm(model, self._moments, ledger)

    def begin_step(self, weight: float, contributes: bool = True) -> None:
        """The next step's backward weight (1 where the loss is weighted already) and whether its rows count."""
        self._weight = float(weight)
        self._contributes = contributes

    @contextmanager
    def alone(self):
        """Within the block every rank uses its own statistics (timing a step alone)."""
        self._alone = True
        try:
            yield
        finally:
            self._alone = False

    def _forward(self, vector: np.ndarray) -> np.ndarray:
        if self._alone:
            return vector
        if not self._contributes:
            vector = np.zeros_like(vector)
        with self.timing.waiting():
            return self.comm.reduce(vector, "summing BatchNorm statistics").copy()

    def _backward(self, vector: np.ndarray) -> np.ndarray:
        if self._alone:
            return vector
        w = self._weight if self._contributes else 0.0  # a stand-in batch neither sends nor takes gradients
        with self.timing.waiting():
            summed = self.comm.reduce(vector * vector.dtype.type(w), "summing BatchNorm gradients").copy()
        return summed / summed.dtype.type(w) if w > 0 else np.zeros_like(summed)

    def _sum(self, vector):
        @tf.custom_gradient
        def summed(v):
            out = tf.numpy_function(self._forward, [v], v.dtype, stateful=True)
            out.set_shape(v.shape)

            def grad(dy):
                g = tf.numpy_function(self._backward, [dy], dy.dtype, stateful=True)
                g.set_shape(dy.shape)
                return g

            return out, grad

        return summed(vector)

    def _moments(self, layer, index: int):
        del index  # the sums pair by their order, the same on every rank

        def moments(x):
            axes = _compat.batchnorm_axes(layer)
            shape = tf.shape(x)
            count = tf.cast(tf.reduce_prod(tf.stack([shape[a] for a in axes])), x.dtype)
            total = tf.reduce_sum(x, axes, keepdims=True)
            squares = tf.reduce_sum(x * x, axes, keepdims=True)
            n = int(np.prod(total.shape))
            packed = self._sum(tf.concat([tf.reshape(total, [-1]), tf.reshape(squares, [-1]),
                                          tf.reshape(count, [1])], 0))
            rows = packed[-1]
            mean = tf.reshape(packed[:n], tf.shape(total)) / rows
            variance = tf.reshape(packed[n : 2 * n], tf.shape(total)) / rows - mean * mean
            return tf.squeeze(mean, axes), tf.squeeze(variance, axes)

        return moments
