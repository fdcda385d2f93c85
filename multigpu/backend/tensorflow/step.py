"""The training, test and predict functions of a parallel model on TensorFlow.

Keras's TensorFlow trainer calls ``model.train_function(iterator)`` once per
``steps_per_execution`` batches.  multigpu gives the model its own
``make_train_function`` (and test, predict), so Keras's ``fit`` loop,
callbacks and History run unchanged.  One global batch, followed from the
data to the weights:

1. the data path cut this rank's rows and queued the batch's plan
   (:mod:`multigpu.keras.data`, through :mod:`.feeding`); the step driver
   takes the plan back (:mod:`multigpu.backend.driver`);
2. the training functions (:mod:`.functions`) compute this rank's gradients
   times ``b_r / B``, sum them over ranks with the metric states and the
   step's message, and apply the sum with the model's ``optimizer.apply``:
   the same update on every rank, equal to one device's on the whole batch.

They are traced once per local batch size (:meth:`TensorFlowSteps._function`
says why).  A ``train_step`` or ``test_step`` of the model's own runs as
:mod:`.custom` says.  With ``sync_batchnorm=True`` every BatchNormalization
layer normalises with the statistics of the global batch (:mod:`.batchnorm`).

With ``min_devices`` a lost device does not end the run: its sum raises
:class:`~multigpu.membership.PeerLostError` over the group of the ranks left
(the engine's, :mod:`multigpu.engine`), and the step is taken again over
them, exactly, by :class:`~multigpu.backend.recovery.Recovery` through the
hooks of :mod:`.states`.  The step then runs as two functions around the sum
(a loss inside one function would leave its later updates unknown), as it
does on a device that may run out of memory.
"""

from __future__ import annotations

from contextlib import nullcontext

import keras
import numpy as np
import tensorflow as tf

from multigpu import membership
from multigpu._keras import compat as _compat
from multigpu.backend.driver import StepDriver
from multigpu.backend.facts import HALF_PRECISION
from multigpu.backend.recovery import Recovery
from multigpu.backend.steps import StepsCore, time_alone
from multigpu.backend.tensorflow.custom import CustomSteps
from multigpu.backend.tensorflow.evaluation import Evaluation
from multigpu.backend.tensorflow.functions import TrainFunctions
from multigpu.backend.tensorflow.memory import GpuMemory
from multigpu.backend.tensorflow.states import States
from multigpu.backend.tensorflow.tensors import tensors
from multigpu.balancing.caps import DeviceMemory
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
        self._fresh: dict | None = None  # global results of the last step, while no metric changed
        self._train: TrainFunctions | None = None
        self._test = self._predict = None
        self._applied = False  # the update function has been traced (by the first training step)
        self._traced: set = set()  # the fused step functions called so far (the first call of each traces it)
        self._concretes: dict = {}  # their concrete functions, by function, batch shapes and message length
        self._local_results = False  # inside a step run eagerly: metric results are this rank's own
        self.recovery = Recovery(self)
        # A GPU by its allocator's statistics; a CPU device given a size by the process (TensorFlow's CPU
        # allocator keeps its pool).
        gpu = self.comm.runtime.devices[self.comm.rank].is_cuda
        self.memory = DeviceMemory(self.comm, self.balancer, GpuMemory() if gpu else None, kept=True)
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
        sizes sit on a grid of 1/32 of the batch (:mod:`.facts`), so there are
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
        self._train = TrainFunctions(self)
        self._applied, self._traced, self._concretes = False, set(), {}

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
        return self.driver.train(data, self._train_on)

    def forget_results(self) -> None:
        self._fresh = None

    def sum_over_all(self, every: bool) -> None:
        """Devices set aside or back (:mod:`multigpu.backend.parking`): with the optimizer state in parts, its
        parts were dealt again, which the traced step functions captured (the variables each rank holds, sized
        by its part): they are made again, and traced at their next call."""
        if self.shards is not None:
            self._train = None

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
        fn = self._train
        traced = not self._applied  # the first step traces every function: not a measurement of the shares
        if plan.local == 0 and fn.sparse is None:
            fn.on_a_row_of_zeros(data)  # which gradients are sparse
        self.timing.begin()
        weight = tf.constant(plan.weight, tf.float32)
        if self.global_batchnorm is not None:
            self.global_batchnorm.begin_step(1.0)  # the loss carries the weight
        if plan.local > 0 and fn.step is not None:
            step = fn.alone if self.comm.alone and fn.alone is not None else fn.step
            traced = traced or step not in self._traced  # (the first step alone traces its own function)
            self._traced.add(step)
            tail = tf.constant(self._message())
            logs, message = self._concrete(step, x, y, sample_weight, tail)(x, y, sample_weight, weight, tail)
            self.driver.finish(message.numpy())
        else:
            parts, short, cap = (None, 0, 0) if plan.local == 0 else self.driver.local(
                plan.local, lambda: [t.numpy() for t in keras.tree.flatten(fn.local(x, y, sample_weight, weight))],
                self.memory.release)
            if parts is None:
                if plan.local == 0 and self.global_batchnorm is not None:
                    fn.on_a_row_of_zeros(data, contributes_to_statistics=True)  # the statistics' sums run
                grads, states, slices = fn.idle_parts()
            else:
                grads, states, *slices = parts
            summed, *slices = fn.exchange(grads, states, self._message(short, cap), *slices)
            rest = summed[grads.size:]
            self._summed_states = rest[: states.size]
            self.driver.heard(rest[states.size:])  # new caps; a rank that ran out: none applies the step
            self.driver.finish(rest[states.size:], list(rest), states.size)
            membership.at("update", self.comm.rank)
            logs = fn.apply(tf.constant(summed), tuple(slices))
        self._applied = True
        self.driver.done(plan, measured=not traced)
        return logs

    def _concrete(self, step, x, y, sample_weight, tail):
        """``step``'s concrete function for this batch's shapes, traced at its first call: called straight, it
        skips the ``tf.function``'s lookup of its traces by the arguments' types (about 0.15 ms a call, measured
        on the MLP's fused step: 0.27 ms against 0.12 ms)."""
        flat = keras.tree.flatten((x, y, sample_weight))
        key = (id(step), tail.shape[0], *(None if t is None else (type(t), tuple(t.shape), t.dtype) for t in flat))
        concrete = self._concretes.get(key)
        if concrete is None:
            weight = tf.constant(0.0, tf.float32)
            concrete = self._concretes[key] = step.get_concrete_function(x, y, sample_weight, weight, tail)
        return concrete

    def _message(self, short: int = 0, cap: int = 0) -> np.ndarray:
        """This rank's step message (:meth:`StepDriver.say <multigpu.backend.driver.StepDriver.say>`), float32."""
        return np.asarray(self.driver.say(short, cap), np.float32)

    def _solo_rate(self, data, rows: int) -> tuple[float, float]:
        """Samples/s of this rank's share of the step alone (traced first, untimed).

        It times the step's own local function, then puts back the metric and
        non-trainable states (BatchNorm statistics, seeds) it moved.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if self._train is None:
            self._build_train()
        kept = [(v, v.numpy()) for v in [*self.model.non_trainable_variables, *self.model.metrics_variables]]
        weight = tf.constant(1.0, tf.float32)
        alone = self.global_batchnorm.alone() if self.global_batchnorm is not None else nullcontext()

        def call():
            return self._train.local(x, y, sample_weight, weight)[1].numpy()

        with alone:
            measured = time_alone(call, rows, first=call)
        for v, value in kept:
            v.assign(value)
        known = {id(v) for v, _ in kept}
        for v in self.model.metrics_variables:  # made by the first call (compiled metrics build then): at 0
            if id(v) not in known:
                v.assign(tf.zeros(v.shape, v.dtype))
        return measured
