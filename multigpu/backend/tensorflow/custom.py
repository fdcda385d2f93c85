"""A ``train_step`` or ``test_step`` of the model's own on TensorFlow (``tf.GradientTape`` and ``optimizer.apply``).

The model's step runs as Keras runs it, in a ``tf.function`` (eagerly with
``run_eagerly``; without XLA, since the sum runs on the host).  While it
runs, every optimizer of the model (``model.optimizer`` and any other among
its attributes: a GAN's two) applies, in ``optimizer.apply`` (which
``apply_gradients`` calls), the gradients times ``b_r / B`` summed over ranks:
one sum per call, a ``tf.numpy_function`` inside the step's graph, ordered
after the step's earlier updates as TensorFlow orders stateful operations.
That ``apply`` is set once per optimizer through the model's ledger (so
``unparallelize`` gives each its own back) and calls the optimizer's own
outside a step of the model's (a graph traced there, or an eager call).  The
step's logs become global in one more sum: metrics from summed states, other
scalars as rows-weighted means; the step timings travel in it (training only).

A rank with no rows, and the memory word a step's first sum carries:
:mod:`multigpu.backend.logs`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from multigpu import membership
from multigpu._keras.model_parts import optimizers_of
from multigpu.backend.logs import other_scalars, read_summed
from multigpu.backend.tensorflow.tensors import flat, metric_results, one_row_of_zeros, split
from multigpu.balancing.caps import OutOfMemoryStepError, is_out_of_memory

__all__ = ["CustomSteps"]


class CustomSteps:
    """The model's own ``train_step``/``test_step``, with sums over ranks.

    Args:
        steps: the model's :class:`~multigpu.backend.tensorflow.step.TensorFlowSteps` (its model,
            collectives, timing, balancer and compression are read from it).
    """

    def __init__(self, steps) -> None:
        self.steps = steps
        self.model = steps.model
        self.comm = steps.comm
        self.timing = steps.timing
        self.balancer = steps.balancer
        self._weight = tf.Variable(0.0, trainable=False, dtype=tf.float32, name="multigpu_gradient_weight")
        self._train = None
        self._test = None
        self._last_batch = None  # the last batch with rows, for the steps where this rank has none
        self._last_test_batch = None
        self._summing = False  # a step of the model's own is running (or being traced)
        self._word = False  # the running step's next sum carries the memory word
        self._first: int | None = None  # the length of a step's first gradient sum (a rank that ran out sends it)
        self._stopped: OutOfMemoryStepError | None = None  # raised inside the step's graph, raised again outside

    def _compiled(self, method):
        model = self.model
        if model.run_eagerly:
            return lambda data: method(model, data)
        return tf.function(lambda data: method(model, data))

    # ---------------------------------------------------------- training
    def train(self, data, plan) -> tuple[dict, dict]:
        """One training step; returns its logs and the global results."""
        idle = plan.local == 0
        if not idle:
            self._last_batch = data
        elif self._last_batch is None:
            self._last_batch = one_row_of_zeros(data)
        if self._train is None:
            self._train = self._compiled(self.steps.user_train_step)
        kept = self._snapshot() if idle else None
        self._weight.assign(0.0 if idle else plan.weight)
        bn = self.steps.global_batchnorm
        if bn is not None:
            bn.begin_step(0.0 if idle else plan.weight, contributes=not idle)
        self.timing.begin()
        self._install()
        self._summing = self._word = True
        try:
            if not idle:
                membership.fault_out_of_memory(self.comm.rank)
            logs = self._train(self._last_batch if idle else data)
        except Exception as exc:
            stopped, self._stopped = self._stopped, None
            if stopped is not None:
                raise stopped from None
            if idle or not self.steps.memory.bounded or not self._word or not is_out_of_memory(exc):
                raise  # (after its first sum, a step that ran out ends the run: some updates were applied)
            self._ran_out(plan.local)
        finally:
            self._summing = False
        if kept is not None:
            self._restore(kept, metrics_only=bn is not None)  # the moving statistics follow the global batch
        logs, fresh = self._global_logs(logs, 0 if idle else plan.local)
        self.timing.end(plan.local)
        return logs, fresh

    def test(self, data, rows: int) -> tuple[dict, dict]:
        """One test step; returns its logs and the global results."""
        if rows > 0:
            self._last_test_batch = data
        elif self._last_test_batch is None:
            self._last_test_batch = one_row_of_zeros(data)
        if self._test is None:
            self._test = self._compiled(self.steps.user_test_step)
        kept = self._snapshot() if rows == 0 else None
        logs = self._test(data if rows > 0 else self._last_test_batch)
        if kept is not None:
            self._restore(kept)
        return self._global_logs(logs, rows, timing=False)

    def _snapshot(self) -> list:
        return [(v, v.numpy()) for v in [*self.model.non_trainable_variables, *self.model.metrics_variables]]

    def _restore(self, kept: list, metrics_only: bool = False) -> None:
        metric_ids = {id(v) for v in self.model.metrics_variables}
        for v, value in kept:
            if not metrics_only or id(v) in metric_ids:
                v.assign(value)

    def _sum(self, vector: np.ndarray) -> np.ndarray:
        """The sum of a weighted gradient vector over ranks; the step's first carries the memory word (which
        raises on every rank where one ran out)."""
        word = self._word
        if word:
            self._word = False
            self._first = vector.size
            vector = np.concatenate([vector, self.steps.memory.word().astype(vector.dtype)])
        with self.timing.waiting():
            summed = self.comm.reduce(vector, "summing gradients").copy()
        if word:
            try:
                self.steps.memory.read_word(summed[self._first :])
            except OutOfMemoryStepError as exc:
                self._stopped = exc  # TensorFlow wraps what a numpy_function raises
                raise
            summed = summed[: self._first]
        return summed

    def _ran_out(self, rows: int) -> None:
        """This rank's step ran out of memory before its first sum (:meth:`DeviceMemory.ran_out
        <multigpu.balancing.caps.DeviceMemory.ran_out>`)."""
        half = self.steps.half
        self.steps.memory.ran_out(rows, self._first, self.model.trainable_variables,
                                  lambda v: self.comm.reduce(v, "summing gradients"),
                                  np.float32 if half is None else half.as_numpy_dtype)

    def _install(self) -> None:
        """Every optimizer's ``apply`` (once each, through the model's ledger) applies the weighted gradients
        summed over ranks while a step of the model's own runs, and is the optimizer's own otherwise."""
        ledger = self.steps.parallel.ledger
        for optimizer in optimizers_of(self.model):
            if not ledger.owns(optimizer, "apply"):
                ledger.set(optimizer, "apply", self._summed_apply(optimizer, optimizer.apply))

    def _summed_apply(self, optimizer, original):
        half = self.steps.half
        weight = self._weight

        def apply(grads, trainable_variables=None):
            if not self._summing:
                return original(grads, trainable_variables)
            grads = list(grads)
            variables = list(trainable_variables) if trainable_variables is not None else None
            like = variables if variables is not None else list(optimizer._trainable_variables)
            dense = [tf.zeros(v.shape, tf.float32) if g is None else tf.convert_to_tensor(g)
                     for g, v in zip(grads, like)]
            vector = tf.concat([tf.zeros(0, tf.float32), *(g * weight for g in flat(dense))], 0)
            # no rows here: zeros, whatever the step computed on its stand-in batch (NaN included)
            vector = tf.where(weight > 0, vector, tf.zeros_like(vector))
            if half is not None:
                vector = tf.cast(vector, half)
            summed = tf.numpy_function(self._sum, [vector], vector.dtype, stateful=True)
            summed = tf.cast(tf.reshape(summed, [-1]), tf.float32)
            return original(split(summed, dense), variables)

        return apply

    # ---------------------------------------------------------- logs
    def _global_logs(self, logs: dict, rows: int, timing: bool = True) -> tuple[dict, dict]:
        """The step's logs over every rank, and every global metric result (:mod:`multigpu.backend.logs`)."""
        refs = list(self.model.metrics_variables)
        logs = dict(logs)
        extra, tail = other_scalars(logs, set(self.steps.keras_metrics_result()), rows,
                                    self.timing.vector() if timing else ())
        n_states = sum(int(np.prod(v.shape)) for v in refs)
        states = self.steps._states()
        summed = self.comm.reduce(np.concatenate([states, tail]), "summing the step's logs").copy()
        results = metric_results(self.model, tf.constant(summed), refs, 0)
        return read_summed(logs, summed, n_states, extra, results, self.balancer if timing else None,
                           self.comm.world_size)
