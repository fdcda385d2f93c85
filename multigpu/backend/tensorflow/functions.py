"""What Keras's TensorFlow ``train_step`` computes, split at the step's sum (a part of :class:`.step.TensorFlowSteps`).

* ``local`` computes, on this rank's rows, the loss, its scaling, the
  gradients and the metric updates, and returns the gradients times
  ``b_r / B`` as one vector (16 bits with ``compression``) beside the metric
  states and the sparse gradients' rows (the weight is an argument: a new
  share does not retrace);
* :meth:`TrainFunctions.exchange` makes the step's one sum over ranks of
  that vector, the metric states and the step's message (:mod:`.collectives`);
* ``apply`` applies the summed gradient with the model's ``optimizer.apply``
  (clipping, accumulation, EMA, loss scaling as Keras does them) and reads the
  global logs from the summed metric states;
* ``step`` runs the three as one ``tf.function``, the sum a
  ``tf.numpy_function`` inside it: one call into TensorFlow a step (measured:
  the MLP at batch 64 on two CPU devices, 4.5 ms a step as two functions
  around the sum, 3.7 to 4.0 ms as one).  Each gradient goes to the
  ``numpy_function`` as it is and is written straight into the sum's buffer
  (:meth:`Comm.reduce_parts <multigpu.backend.tensorflow.collectives.Comm.reduce_parts>`):
  no joined vector in the graph, none in NumPy (the step's cost beyond the
  rank's own work: 1.4 to 1.9 ms against 2.4 to 3.1 ms,
  ``benchmarks/tensorflow/README.md``).  It is None where a step must be
  taken again from between the two (a run that may lose a rank, a device
  that may run out of memory) or where XLA compiles them (it cannot call
  into Python);
* ``alone`` is ``step`` for the one rank left while the others are set aside
  (:mod:`multigpu.backend.parking`): its sum is its own vector, in the
  graph, and the optimizer state it owns whole is shared with nobody, so the
  step never leaves TensorFlow (traced on its first call, while the rank is
  alone).

A rank with no rows sends zeros and its unchanged metric states
(:meth:`TrainFunctions.idle_parts`).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import keras
import numpy as np
import tensorflow as tf

from multigpu._keras import compat as _compat
from multigpu.backend.tensorflow.tensors import flat, metric_results, one_row_of_zeros, split

__all__ = ["TrainFunctions"]


class TrainFunctions:
    """The training functions of one parallel model, traced once per local batch size.

    Args:
        steps: the model's :class:`~multigpu.backend.tensorflow.step.TensorFlowSteps` (its model, collectives,
            timing, compression, global BatchNorm and ``_function`` are used).
    """

    def __init__(self, steps) -> None:
        self.steps = steps
        model = steps.model
        trainable = list(model.trainable_variables)
        self.trainable = trainable
        half = steps.half
        training_arg = _compat.call_has_training_arg(model)
        self.sparse: dict[int, np.dtype] | None = None  # variables with IndexedSlices gradients: index dtype

        def parts(x, y, sample_weight, weight):
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True) if training_arg else model(x)
                loss = _compat.compute_loss(model, x, y, y_pred, sample_weight, training=True)
                tracker = _compat.loss_tracker(model)
                if tracker is not None:
                    tracker.update_state(loss, sample_weight=tf.shape(keras.tree.flatten(x)[0])[0])
                if model.optimizer is not None:
                    loss = model.optimizer.scale_loss(loss)
                loss = loss * tf.cast(weight, loss.dtype)  # b_r / B: what global BatchNorm sums back, too
            grads = tape.gradient(loss, trainable) if trainable else []
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            self.sparse = {i: g.indices.dtype.as_numpy_dtype for i, g in enumerate(grads)
                           if isinstance(g, tf.IndexedSlices)}
            dense = [tf.zeros_like(v) if g is None else g for i, (g, v) in enumerate(zip(grads, trainable))
                     if i not in self.sparse]
            states = tf.concat([tf.zeros(0, tf.float32), *flat([v.value for v in model.metrics_variables])], 0)
            slices = tuple(t for i in self.sparse for t in (tf.cast(grads[i].values, tf.float32),
                                                             grads[i].indices))
            return flat(dense), states, slices

        def local(x, y, sample_weight, weight):
            dense, states, slices = parts(x, y, sample_weight, weight)
            vector = tf.concat([tf.zeros(0, tf.float32), *dense], 0)
            return (vector if half is None else tf.cast(vector, half)), states, slices

        def apply(summed, slices):
            if trainable:
                sparse = self.sparse or {}
                dense = iter(split(summed, [v for i, v in enumerate(trainable) if i not in sparse]))
                pairs = iter(zip(slices[::2], slices[1::2]))
                grads = []
                for i, v in enumerate(trainable):
                    if i in sparse:
                        values, indices = next(pairs)
                        grads.append(tf.IndexedSlices(tf.cast(values, v.dtype), indices, tf.shape(v)))
                    else:
                        grads.append(next(dense))
                model.optimizer.apply(grads, trainable)
            n_dense = sum(int(np.prod(v.shape)) for i, v in enumerate(trainable) if i not in (self.sparse or {}))
            return metric_results(model, summed, list(model.metrics_variables), n_dense)

        def step(x, y, sample_weight, weight, tail):
            if half is None:  # each gradient handed over as it is, written straight into the sum's buffer
                dense, states, slices = parts(x, y, sample_weight, weight)
                n = sum(d.shape[0] for d in dense)
                out = tf.numpy_function(partial(self._exchange_parts, len(dense)), [states, tail, *dense, *slices],
                                        [tf.float32, *(t.dtype for t in slices)], stateful=True)
            else:
                vector, states, slices = local(x, y, sample_weight, weight)
                n = vector.shape[0]
                out = tf.numpy_function(self.exchange, [vector, states, tail, *slices],
                                        [tf.float32, *(t.dtype for t in slices)], stateful=True)
            summed, gathered = out[0], out[1:]
            summed.set_shape([n + states.shape[0] + tail.shape[0]])
            for part, mine in zip(gathered, slices):
                part.set_shape([None, *mine.shape[1:]])
            return apply(summed, tuple(gathered)), summed[n + states.shape[0] :]

        def alone(x, y, sample_weight, weight, tail):
            dense, states, slices = parts(x, y, sample_weight, weight)
            summed = tf.concat([tf.zeros(0, tf.float32), *dense, states, tail], 0)  # (the sum over itself)
            return apply(summed, slices), summed[summed.shape[0] - tail.shape[0] :]

        self.local = steps._function(local)
        self.apply = steps._function(apply, jit=False if steps.shards is not None else None)  # XLA calls no Python
        fused = (not model.run_eagerly and not model.jit_compile and not steps.recovery.elastic
                 and not steps.memory.bounded)
        self.step = steps._function(step) if fused else None
        self.alone = steps._function(alone) if fused and half is None else None

    def exchange(self, vector: np.ndarray, states: np.ndarray, tail: np.ndarray, *slices: np.ndarray):
        """The step's sum over ranks: weighted gradients, metric states and message (float32, the gradients in
        16 bits with ``compression``); the sparse rows gathered in rank order.  Returns the sum and the rows."""
        return self._exchange([vector], states, tail, slices)

    def _exchange_parts(self, k: int, states: np.ndarray, tail: np.ndarray, *arrays: np.ndarray) -> tuple:
        """:meth:`exchange` as the fused step calls it: ``k`` gradient parts, then the sparse rows."""
        return self._exchange(arrays[:k], states, tail, arrays[k:])

    def _exchange(self, dense, states: np.ndarray, tail: np.ndarray, slices) -> tuple:
        """:meth:`exchange` of the gradient vector in ``dense`` parts (float32: each written into the sum's
        buffer, no joined copy first)."""
        steps = self.steps
        with steps.timing.waiting():
            if steps.half is None:  # (a copy: the engine's buffer is written again two sums later)
                summed = steps.comm.reduce_parts([*dense, states, tail], "summing gradients").copy()
            else:
                vector = steps.comm.reduce(dense[0], "summing gradients").astype(np.float32)
                summed = np.concatenate([vector, steps.comm.reduce(np.concatenate([states, tail]),
                                                                   "summing the step's metrics")])
            gathered = steps.comm.concatenate(list(slices)) if len(slices) else []
        return (summed, *gathered)

    def idle_parts(self) -> tuple[np.ndarray, np.ndarray, list]:
        """What a rank with no rows sends: zero gradients, its metric states, no sparse rows."""
        self.sparse = {} if self.sparse is None else self.sparse
        n = sum(int(np.prod(v.shape)) for i, v in enumerate(self.trainable) if i not in self.sparse)
        slices = []
        for i, dtype in self.sparse.items():
            slices += [np.zeros((0, *self.trainable[i].shape[1:]), np.float32), np.zeros(0, dtype)]
        half = self.steps.half
        return np.zeros(n, np.float32 if half is None else half.as_numpy_dtype), self.steps._states(), slices

    def on_a_row_of_zeros(self, data, contributes_to_statistics: bool = False) -> None:
        """``local`` on a stand-in row of zeros shaped as ``data``, with weight 0, its effects on the model's
        metric (and non-trainable) states undone.

        A rank with no rows runs it, before its first step to learn which
        gradients are sparse, and at every step with global BatchNorm
        statistics, whose sums must run (``contributes_to_statistics``: the
        row adds nothing to them, and the moving statistics follow the global
        batch, as on the other ranks; TensorFlow's Conv2D mis-shapes an empty
        batch).
        """
        model = self.steps.model
        bn = self.steps.global_batchnorm
        kept = list(model.metrics_variables)
        if contributes_to_statistics:
            bn.begin_step(1.0, contributes=False)
            alone = nullcontext()
        else:
            kept += list(model.non_trainable_variables)
            alone = bn.alone() if bn is not None else nullcontext()
        kept = [(v, v.numpy()) for v in kept]
        x, y, sample_weight = (one_row_of_zeros(part) for part in keras.utils.unpack_x_y_sample_weight(data))
        with alone:
            self.local(x, y, sample_weight, tf.constant(0.0, tf.float32))
        for v, value in kept:
            v.assign(value)
