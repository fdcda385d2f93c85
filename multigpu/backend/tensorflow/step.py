"""The training, test and predict functions of a parallel model on TensorFlow.

Keras's TensorFlow trainer calls ``model.train_function(iterator)`` once per
``steps_per_execution`` batches.  multigpu gives the model its own
``make_train_function`` (and test, predict), so Keras's ``fit`` loop,
callbacks and History run unchanged.  One global batch, followed from the
data to the weights:

1. the data path cut this rank's rows and queued the batch's plan
   (:mod:`multigpu.keras.data`, through :mod:`.feeding`); the function takes
   the plan back;
2. ``local`` computes, on this rank's rows, what Keras's TensorFlow
   ``train_step`` computes (loss, loss scaling, gradients, metric updates)
   and returns the gradients times ``b_r / B`` as one vector beside the
   metric states (the weight is an argument: a new share does not retrace);
3. ``exchange`` makes the step's one sum over ranks (:mod:`.collectives`) of
   that vector, the metric states and the step timings;
4. ``apply`` applies the summed gradient with the model's
   ``optimizer.apply`` (clipping, accumulation, EMA, loss scaling as Keras
   does them) and reads the global logs from the summed metric states: the
   same update on every rank, equal to one device's on the whole batch.

The three run as one ``tf.function`` (traced once per local batch size:
:meth:`TensorFlowSteps._function` says why), the sum a ``tf.numpy_function``
inside it: one call into TensorFlow a step (measured: the MLP at batch 64 on
two CPU devices, 4.5 ms a step as two functions around the sum, 3.7 to 4.0 ms as
one).  With ``jit_compile`` (XLA cannot compile a call into Python) ``local``
and ``apply`` are two compiled functions and the sum runs between them.  A
rank with no rows in a step sends zeros and its unchanged metric states.
With ``compression`` the weighted gradients go in 16 bits, in a sum of their
own beside the float32 rest.  A ``train_step`` or ``test_step`` of the
model's own runs as :mod:`.custom` says.  With ``sync_batchnorm=True`` every
BatchNormalization layer normalises with the statistics of the global batch
(:mod:`.batchnorm`).

With ``min_devices`` a lost device does not end the run: its sum raises
:class:`~multigpu.membership.PeerLostError` over the group of the ranks left
(the engine's, :mod:`multigpu.engine`), and the step is taken again over
them, exactly, by :class:`~multigpu.backend.recovery.Recovery` through the
hooks below (``snapshot``, ``restore_forward``, ``undo_updates``,
``take_over_metrics``, ``metrics_from_zero``, ``finish_sum``).  The step then
runs as two functions around the sum (a loss inside one function would leave
its later updates unknown), and the sum's last word says when a lost rank
started again waits to come back.
"""

from __future__ import annotations

from contextlib import nullcontext

import keras
import numpy as np
import tensorflow as tf

from multigpu import membership
from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import batch_rows
from multigpu.backend.driver import StepDriver
from multigpu.backend.facts import HALF_PRECISION
from multigpu.backend.message import StepMessage
from multigpu.backend.recovery import Recovery
from multigpu.backend.steps import StepsCore, time_alone
from multigpu.backend.tensorflow.custom import CustomSteps
from multigpu.backend.tensorflow.evaluation import Evaluation
from multigpu.backend.tensorflow.states import States
from multigpu.backend.tensorflow.tensors import flat, metric_results, one_row_of_zeros, split, tensors
from multigpu.balancing.caps import DeviceMemory, is_out_of_memory
from multigpu.balancing.timing import StepRecord
from multigpu.membership import PeerLostError

__all__ = ["TensorFlowSteps"]


class TensorFlowSteps(Evaluation, States, StepsCore):
    """The functions of one parallel model on TensorFlow (see the module docstring and
    :mod:`multigpu.backend.steps`).

    Args:
        parallel: the model's :class:`~multigpu.keras.parallel.ParallelModel`.
    """

    def __init__(self, parallel) -> None:
        super().__init__(parallel)
        compression = parallel.options.compression
        self.half = None if compression is None else getattr(tf, HALF_PRECISION[compression])
        self.global_batchnorm = None
        if parallel.options.sync_batchnorm:
            from multigpu.backend.tensorflow.batchnorm import GlobalBatchNorm

            self.global_batchnorm = GlobalBatchNorm(self.model, self.comm, self.timing, parallel.ledger)
        self.custom = CustomSteps(self)
        if parallel.options.shard_optimizer:
            from multigpu.backend.tensorflow.sharding import ShardedOptimizers

            self.shards = ShardedOptimizers(self.comm, parallel.ledger)
        self.keras_reset_metrics = type(self.model).reset_metrics.__get__(self.model)
        self.keras_metrics_result = keras.Model.get_metrics_result.__get__(self.model)
        self._fresh: dict | None = None  # global results of the last step, while no metric changed
        self._train = self._test = self._predict = None
        self._applied = False  # the update function has been traced (by the first training step)
        self._local_results = False  # inside a step run eagerly: metric results are this rank's own
        self.recovery = Recovery(self)
        # A CPU device given a size is measured (TensorFlow's allocator keeps its pool); a GPU is not yet.
        self.memory = DeviceMemory(self.comm, self.balancer, kept=True)
        self.message = StepMessage(self.timing.size, self.comm.world_size)
        self.driver = StepDriver(self, batch=tensors)
        self._kept_metrics: np.ndarray | None = None  # this rank's metric states before the step (recovery)
        self._kept_updates: list | None = None  # a step of the model's own: what its updates may change
        self._summed_states: np.ndarray | None = None  # the last global metric states read

    def methods(self) -> dict:
        """What the model instance gets."""
        return {"make_train_function": self.make_train_function, "make_test_function": self.make_test_function,
                "make_predict_function": self.make_predict_function,
                "get_metrics_result": self.get_metrics_result, "reset_metrics": self.reset_metrics}

    def _function(self, fn, jit: bool | None = None):
        """``fn`` as a ``tf.function`` traced once per local batch size (eager with ``run_eagerly``).

        Keras's own step is traced again with an unknown batch size once it
        sees a second one; multigpu keeps every trace's batch size known,
        because Keras weighs each output's loss by the static batch size
        (``CompileLoss``), and XLA compiles per shape anyway.  The local batch
        sizes sit on a grid of 1/16 of the batch (:mod:`.facts`), so there are
        few traces.  Run eagerly, the model's ``compute_metrics`` inside it
        returns its local results, as it does in a trace (no sum over ranks
        in the middle of a step: a rank with no rows does not run it).
        """
        if self.model.run_eagerly:
            def eagerly(*args):
                self._local_results = True
                try:
                    return fn(*args)
                finally:
                    self._local_results = False

            return eagerly
        jit = bool(self.model.jit_compile) if jit is None else jit
        if self.global_batchnorm is not None:
            jit = False  # the BatchNorm sums run on the host, inside the step
        return tf.function(fn, jit_compile=jit)

    def _batches(self, one, iterator) -> list:
        """The outputs of ``one(batch)`` for up to ``steps_per_execution`` batches of ``iterator``; each batch is
        a step of its own (its plan, sum and timing).  Raises StopIteration when it has none."""
        outputs = [one(next(iterator))]
        for _ in range(self.model.steps_per_execution - 1):
            try:
                data = next(iterator)
            except StopIteration:
                break
            outputs.append(one(data))
        return outputs

    # ---------------------------------------------------------- training
    def _build_train(self) -> None:
        model = self.model
        trainable = list(model.trainable_variables)
        half = self.half
        training_arg = _compat.call_has_training_arg(model)
        self._sparse: dict[int, np.dtype] | None = None  # variables with IndexedSlices gradients: index dtype

        def local(x, y, sample_weight, weight):
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
            self._sparse = {i: g.indices.dtype.as_numpy_dtype for i, g in enumerate(grads)
                            if isinstance(g, tf.IndexedSlices)}
            dense = [tf.zeros_like(v) if g is None else g for i, (g, v) in enumerate(zip(grads, trainable))
                     if i not in self._sparse]
            vector = tf.concat([tf.zeros(0, tf.float32), *flat(dense)], 0)
            states = tf.concat([tf.zeros(0, tf.float32), *flat([v.value for v in model.metrics_variables])], 0)
            slices = tuple(t for i in self._sparse for t in (tf.cast(grads[i].values, tf.float32),
                                                              grads[i].indices))
            return (vector if half is None else tf.cast(vector, half)), states, slices

        def apply(summed, slices):
            if trainable:
                sparse = self._sparse or {}
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
            n_dense = sum(int(np.prod(v.shape)) for i, v in enumerate(trainable) if i not in (self._sparse or {}))
            return metric_results(model, summed, list(model.metrics_variables), n_dense)

        def step(x, y, sample_weight, weight, tail):
            vector, states, slices = local(x, y, sample_weight, weight)
            parts = tf.numpy_function(self._exchange, [vector, states, tail, *slices],
                                      [tf.float32, *(t.dtype for t in slices)], stateful=True)
            summed, gathered = parts[0], parts[1:]
            summed.set_shape([vector.shape[0] + states.shape[0] + tail.shape[0]])
            for part, mine in zip(gathered, slices):
                part.set_shape([None, *mine.shape[1:]])
            return apply(summed, tuple(gathered)), summed[vector.shape[0] + states.shape[0] :]

        self._local = self._function(local)
        self._apply = self._function(apply, jit=False if self.shards is not None else None)  # XLA calls no Python
        # XLA cannot call into Python; a run that may lose a rank, or a device that may run out of memory, takes
        # a step again from between the two
        fused = (not self.model.run_eagerly and not self.model.jit_compile and not self.recovery.elastic
                 and not self.memory.bounded)
        self._step = self._function(step) if fused else None
        self._applied = False
        self._train = True

    def _exchange(self, vector: np.ndarray, states: np.ndarray, tail: np.ndarray, *slices: np.ndarray):
        """The step's sum over ranks: weighted gradients, metric states and timings (float32, the gradients in 16
        bits with ``compression``); the sparse rows gathered in rank order.  Returns the sum and the rows."""
        rest = np.concatenate([states, tail])
        with self.timing.waiting():
            if self.half is None:
                summed = self.comm.reduce(np.concatenate([vector, rest]), "summing gradients").copy()
            else:
                vector = self.comm.reduce(vector, "summing gradients").astype(np.float32)
                summed = np.concatenate([vector, self.comm.reduce(rest, "summing the step's metrics")])
            gathered = self.comm.concatenate(list(slices)) if slices else []
        return (summed, *gathered)

    def _train_function(self, iterator):
        return self._batches(self._train_batch, iterator)[-1]

    def _ready(self, data) -> None:
        """Before the first step of any kind: the model, its compiled metrics and loss and its optimizer built
        from the batch's shapes, as Keras's torch and JAX ``fit`` build them (Keras's TensorFlow trainer leaves
        that to its traced step, but multigpu's functions take the model's variables when they are made: a
        ``Sequential`` without an ``Input`` would train nothing), then rank 0's weights everywhere."""
        if self._initialized:
            return
        model = self.model
        optimizer_unbuilt = model.optimizer is not None and not model.optimizer.built
        if not model.built or optimizer_unbuilt or not all(layer.built for layer in model.layers):
            _compat.symbolic_build(model, data)
            self._train = self._test = None  # made again, with the variables the build created
        self._initialize()

    def _train_batch(self, data) -> dict:
        self._ready(data)
        if self._train is None:
            self._build_train()
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self.driver.train(data, batch_rows(x), self._train_on, self._calibrate_on)

    def _calibrate_on(self, data, plan) -> None:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._calibrate(lambda: self._solo_rate(x, y, sample_weight, plan.local))

    def lost_peer(self, exc: BaseException):
        """A loss inside a TensorFlow function comes wrapped in TensorFlow's error: the engine kept it."""
        return self.comm.take_lost() or (exc if isinstance(exc, PeerLostError) else None)

    def _train_on(self, data, plan) -> dict:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        membership.at("forward", self.comm.rank)
        self._fresh = None
        if self.shards is not None:
            self.see_optimizers()
            self.shards.before_step()
        if self.user_train_step is not None:
            if self.recovery.elastic:  # its logs are summed after its updates: what they change is kept
                self._kept_updates = [(v, v.numpy()) for v in self._state_variables(with_optimizers=True)]
            logs, self._fresh = self.custom.train(data, plan)
            self._kept_updates = None
            return logs
        traced = not self._applied  # the first step traces every function: not a measurement of the shares
        if plan.local == 0 and self._sparse is None:
            self._learn_gradients(x, y, sample_weight)
        self.timing.begin()
        weight = tf.constant(plan.weight, tf.float32)
        if self.global_batchnorm is not None:
            self.global_batchnorm.begin_step(1.0)  # the loss carries the weight
        if plan.local > 0 and self._step is not None:
            tail = self._message()
            logs, message = self._step(x, y, sample_weight, weight, tf.constant(tail))
            said = self.message.read(message.numpy())
        else:
            grads, states, slices, short, cap = self._local_parts(x, y, sample_weight, weight, plan.local)
            summed, *slices = self._exchange(grads, states, self._message(short, cap), *slices)
            rest = summed[grads.size:]
            self._summed_states = rest[: states.size]
            said = self.message.read(rest[states.size:])
            self.recovery.read(list(rest), states.size, waiting=said.waiting)
            self.memory.read(said.short, said.cap)  # new caps; a rank that ran out: none applies the step
            membership.at("update", self.comm.rank)
            logs = self._apply(tf.constant(summed), tuple(slices))
        self._applied = True
        self._record(said.timing)
        self.memory.fitted(plan.sizes)
        self.timing.end(plan.local)
        if traced:
            self.timing.discard()
        return logs

    def _local_parts(self, x, y, sample_weight, weight, rows: int):
        """This rank's part of the sum, the step taken as two functions around it: ``(weighted gradients, metric
        states, sparse rows, rows it could not hold, its measured cap)``; a rank that ran out of memory sends
        what a rank with no rows sends, and says so."""
        short = cap = 0
        if rows > 0:
            try:
                self.memory.begin(rows)
                membership.fault_out_of_memory(self.comm.rank)
                grads, states, slices = self._local(x, y, sample_weight, weight)
                grads, states, slices = grads.numpy(), states.numpy(), [t.numpy() for t in slices]
                cap = self.memory.end(rows)
                return grads, states, slices, 0, cap
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                short = rows  # this rank goes on to the sum with no gradients and says it ran out
                self.memory.release()
                self._sparse = {} if self._sparse is None else self._sparse
        elif self.global_batchnorm is not None:
            self._exchange_idle(x, y, sample_weight)
        return (*self._idle_parts(), short, cap)

    def _message(self, short: int = 0, cap: int = 0) -> np.ndarray:
        """This rank's step message (:mod:`multigpu.backend.message`), as float32."""
        return np.asarray(self.message.pack(self.comm.rank, self.timing.vector(), self.recovery.waiting(), short,
                                            cap), np.float32)

    def _idle_parts(self) -> tuple[np.ndarray, np.ndarray, list]:
        """What a rank with no rows sends: zero gradients, its metric states, no sparse rows."""
        trainable = list(self.model.trainable_variables)
        n = sum(int(np.prod(v.shape)) for i, v in enumerate(trainable) if i not in self._sparse)
        slices = []
        for i, dtype in self._sparse.items():
            slices += [np.zeros((0, *trainable[i].shape[1:]), np.float32), np.zeros(0, dtype)]
        grads = np.zeros(n, np.float32 if self.half is None else self.half.as_numpy_dtype)
        return grads, self._states(), slices

    def _exchange_idle(self, x, y, sample_weight) -> None:
        """No rows here, but the global BatchNorm sums must run: the step's own function on a stand-in row of
        zeros that adds nothing to them (weight 0; TensorFlow's Conv2D mis-shapes an empty batch), its metric
        updates undone.  The moving statistics follow the global batch, as on the other ranks."""
        kept = [(v, v.numpy()) for v in self.model.metrics_variables]
        self.global_batchnorm.begin_step(1.0, contributes=False)
        x, y, sample_weight = (one_row_of_zeros(part) for part in (x, y, sample_weight))
        self._local(x, y, sample_weight, tf.constant(0.0, tf.float32))
        for v, value in kept:
            v.assign(value)

    def _learn_gradients(self, x, y, sample_weight) -> None:
        """Which gradients are sparse, for a rank whose first step has no rows: the step on one row of zeros,
        its effects on the model's states undone."""
        kept = [(v, v.numpy()) for v in [*self.model.non_trainable_variables, *self.model.metrics_variables]]
        x, y, sample_weight = (one_row_of_zeros(part) for part in (x, y, sample_weight))
        with self.global_batchnorm.alone() if self.global_batchnorm is not None else nullcontext():
            self._local(x, y, sample_weight, tf.constant(0.0, tf.float32))
        for v, value in kept:
            v.assign(value)

    def _record(self, timing: list[float], adopt: dict | None = None) -> None:
        """Reads a training step's summed timings."""
        rec = StepRecord.from_vector(timing, self.comm.world_size, complete=True, members=self.comm.members)
        if adopt is None:
            self.balancer.record(rec)
        else:
            self.balancer.caught_up(rec, **adopt)

    def _solo_rate(self, x, y, sample_weight, rows: int, *, min_steps: int = 2, min_seconds: float = 1.0,
                   max_steps: int = 30) -> tuple[float, float]:
        """Samples/s of this rank's share of the step alone (traced first, untimed).

        It times the step's own local function, then puts back the metric and
        non-trainable states (BatchNorm statistics, seeds) it moved.
        """
        if rows == 0 or self.user_train_step is not None:
            return 0.0, 0.0  # a custom step's cost is its own: the search finds its shares
        if self._train is None:
            self._build_train()
        kept = [(v, v.numpy()) for v in [*self.model.non_trainable_variables, *self.model.metrics_variables]]
        weight = tf.constant(1.0, tf.float32)
        alone = self.global_batchnorm.alone() if self.global_batchnorm is not None else nullcontext()

        def call():
            return self._local(x, y, sample_weight, weight)[1].numpy()

        with alone:
            measured = time_alone(call, rows, first=call, min_steps=min_steps, min_seconds=min_seconds,
                                  max_steps=max_steps)
        for v, value in kept:
            v.assign(value)
        return measured
