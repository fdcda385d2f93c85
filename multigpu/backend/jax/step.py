"""The training, test and predict functions of a parallel model on JAX.

Keras's JAX trainer runs ``model.train_function(state, iterator)`` once per
batch, ``state`` being the tuple of every variable's value.  multigpu gives
the model its own ``make_train_function`` (and test, predict), so Keras's
``fit`` loop, callbacks and History run unchanged.  One global batch, followed
from the data to the weights:

1. the data path cut this rank's rows and queued the batch's plan
   (:mod:`multigpu.keras.data`); the function takes the plan back;
2. a compiled function computes, on this rank's rows, Keras's loss and
   gradients (``compute_loss_and_updates``) and metric updates, and packs the
   gradients times ``b_r / B``, the metric states and the step timings into
   one vector (the weight is an argument, so a new share does not recompile;
   a new number of local rows does, once per size);
3. one XLA all-reduce sums the vectors over ranks (:mod:`.collectives`);
4. a compiled function applies the summed gradient with Keras's
   ``optimizer.stateless_apply`` and reads the global logs from the summed
   metric states: the same update on every rank, equal to one device's on
   the whole batch.

A rank with no rows in a step sends zeros and its unchanged metric states.
With ``sync_batchnorm=True`` every BatchNormalization layer sums its
statistics over ranks inside step 2 (:mod:`.batchnorm`), and a rank with no
rows runs the forward and backward pass on its empty batch all the same, so
that it takes part in every exchange.  With ``compression`` the weighted gradients go in 16 bits, in a collective of
their own beside the float32 rest (as on torch).

Each training step runs through the one step driver
(:mod:`multigpu.backend.driver`): the step's message
(:mod:`multigpu.backend.message`) ends the vector, and where a device's
memory is bounded the state the step starts from is kept, so that a step in
which a rank ran out of memory is taken again with the batch cut again
(:mod:`multigpu.balancing.caps`).  Test and predict functions:
:mod:`.evaluation`.

A ``train_step`` or ``test_step`` of the model's own (JAX's stateless style)
runs eagerly (:mod:`.custom`).  When the ranks run on different kinds of
processor, rank 0's weights and optimizer state are sent to all at every
epoch's end (:meth:`multigpu.backend.steps.StepsCore.realign_replicas`), as on
torch.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import keras
import numpy as np

from multigpu._keras import compat as _compat
from multigpu.backend.driver import StepDriver
from multigpu.backend.jax.custom import EagerSteps
from multigpu.backend.jax.evaluation import Evaluation
from multigpu.backend.jax.memory import GpuMemory
from multigpu.backend.jax.packing import COMPRESSION, flat, metric_results, split
from multigpu.backend.recovery import Recovery
from multigpu.backend.steps import StepsCore, time_alone
from multigpu.balancing.caps import DeviceMemory

__all__ = ["JaxSteps"]


class JaxSteps(Evaluation, StepsCore):
    """The functions of one parallel model on JAX (see the module docstring and :mod:`multigpu.backend.steps`).

    Args:
        parallel: the model's :class:`~multigpu.keras.parallel.ParallelModel`.
    """

    initialize_when_made = True

    def __init__(self, parallel) -> None:
        super().__init__(parallel)
        model = self.model
        self.half = COMPRESSION[parallel.options.compression]
        self.exchange = None  # global BatchNorm statistics (``sync_batchnorm=True``): summed inside the step
        if parallel.options.sync_batchnorm:
            from multigpu.backend.jax.batchnorm import StatisticsExchange, install_global_moments
            from multigpu.backend.jax.group import coordination_client

            self.exchange = StatisticsExchange(coordination_client(), self.comm.rank, self.comm.world_size,
                                               parallel.runtime.timeout)
            install_global_moments(model, self.exchange, parallel.ledger)
        if parallel.options.shard_optimizer:
            from multigpu.backend.jax.sharding import ShardedOptimizers

            self.shards = ShardedOptimizers(self.comm, parallel.ledger)
        self.recovery = Recovery(self)  # JAX's sums end the run after a lost device: a step is kept for memory
        self.memory = DeviceMemory(self.comm, self.balancer, probe=GpuMemory(self.comm.device))
        self.driver = StepDriver(self)
        self._state: tuple | None = None  # the state the step running now starts from (the driver may retry it)
        self._kept: tuple | None = None  # copies of the state a step donates, while it may be taken again
        self.eager = EagerSteps(self)  # a train_step or test_step of the model's own
        self._fresh: dict | None = None  # global results of the last step, while no metric changed
        self._train = None
        self._test = None
        self._predict = None
        self.compiles: dict[tuple[str, int], float] = {}  # (function, local rows) -> seconds of its first call
        self._compiled = False  # the step running now compiled a function
        self._applied = False  # the update function has been compiled (by the first training step)
        self._ahead = None  # the last step alone's message, which JAX may still be computing (_train_alone)

    def methods(self) -> dict:
        """What the model instance gets."""
        return {"make_train_function": self.make_train_function, "make_test_function": self.make_test_function,
                "make_predict_function": self.make_predict_function,
                "get_metrics_result": self.get_metrics_result, "reset_metrics": self.reset_metrics}

    def _batches(self, one, state, iterator, concatenate: bool = False):
        """``steps_per_execution`` batches through ``one(state, data)``, one after another, as Keras's JAX
        trainer runs them (each batch is a step of its own: its plan, collective and timing)."""
        outputs, state = one(state, next(iterator))
        if self.model.steps_per_execution == 1:
            return outputs, state
        collected = [outputs]
        for _ in range(self.model.steps_per_execution - 1):
            try:
                data = next(iterator)
            except StopIteration:
                break
            outputs, state = one(state, data)
            collected.append(outputs)
        if concatenate:
            outputs = keras.tree.map_structure(lambda *parts: jnp.concatenate(parts), *collected)
        return outputs, state

    def _timed_first(self, name: str, rows: int, call):
        """Runs ``call``; the first call per (function, rows) compiles it, and is timed and logged as such."""
        key = (name, rows)
        if key in self.compiles:
            return call()
        began = time.perf_counter()
        out = call()
        jax.block_until_ready(out)
        self.compiles[key] = seconds = time.perf_counter() - began
        self._compiled = True
        self.balancer.log(f"compiled the {name} step for {rows} local rows in {seconds:.1f} s "
                          f"({len(self.compiles)} compilation(s), {sum(self.compiles.values()):.1f} s in all; once "
                          "per local batch size, and not counted as a measurement)")
        return out

    # ---------------------------------------------------------- training
    def _build_train(self) -> None:
        model = self.model
        trainable_refs = self._trainable_refs = list(model.trainable_variables)
        metric_refs = list(model.metrics_variables)
        n_grads = sum(int(np.prod(v.shape)) for v in trainable_refs)
        n_states = sum(int(np.prod(v.shape)) for v in metric_refs)
        self._n_grads, self._n_states = n_grads, n_states
        half = self.half

        def pack(grads, metrics, tail):
            """One float32 vector; with compression, the gradients in 16 bits and the float32 rest apart."""
            rest = [*flat(metrics), tail]
            if half is None:
                return jnp.concatenate([grads, *rest])
            return grads.astype(half), jnp.concatenate(rest)

        def local(trainable, non_trainable, metrics, optimizer, x, y, sample_weight, weight, tail):
            grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
            (_, aux), grads = grad_fn(trainable, non_trainable, metrics, x, y, sample_weight, training=True,
                                      optimizer_variables=optimizer)
            unscaled, y_pred, non_trainable, metrics = aux
            _, metrics = _compat.update_metrics_variables(model, metrics, unscaled, x, y, y_pred, sample_weight)
            weighted = jnp.concatenate([jnp.zeros(0, jnp.float32), *(g * weight for g in flat(grads))])
            return pack(weighted, metrics, tail), non_trainable, metrics

        def idle(metrics, tail):
            return pack(jnp.zeros(n_grads, jnp.float32), metrics, tail)

        def idle_exchanging(trainable, non_trainable, metrics, x, weight, tail):
            """No rows here, but the global BatchNorm statistics' exchanges must run: the forward pass on no rows
            and its backward (weight 0: the exchange sends zeros, the gradients are zeros)."""

            def forward(trainable, non_trainable):
                y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
                return weight * sum(jnp.sum(leaf) for leaf in jax.tree.leaves(y_pred)), non_trainable

            (_, non_trainable), grads = jax.value_and_grad(forward, has_aux=True)(trainable, non_trainable)
            weighted = jnp.concatenate([jnp.zeros(0, jnp.float32), *(g * weight for g in flat(grads))])
            return pack(weighted, metrics, tail), non_trainable

        def apply(trainable, optimizer, summed):
            grads = split(summed, trainable_refs)
            trainable, optimizer = model.optimizer.stateless_apply(optimizer, grads, trainable)
            return trainable, optimizer, self._results(summed, metric_refs, n_grads)

        def alone(trainable, non_trainable, metrics, optimizer, x, y, sample_weight, weight, tail):
            """The whole step of the one rank left while the others are set aside: its vector is the sum, so the
            update follows in the same compiled function (no host round trip); returns the message too."""
            vector, non_trainable, metrics = local(trainable, non_trainable, metrics, optimizer, x, y,
                                                   sample_weight, weight, tail)
            trainable, optimizer, logs = apply(trainable, optimizer, vector)
            return trainable, optimizer, non_trainable, metrics, logs, vector[n_grads + n_states :]

        self._local = jax.jit(local, donate_argnums=(1, 2))
        self._alone = jax.jit(alone, donate_argnums=(0, 1, 2, 3))
        self._idle = jax.jit(idle)
        self._idle_exchanging = jax.jit(idle_exchanging, donate_argnums=(1,))
        self._apply = jax.jit(apply, donate_argnums=(0, 1))
        self._applied = False
        self._train = True

    def _results(self, summed, metric_refs: list, offset: int) -> dict:
        return metric_results(self.model, summed, metric_refs, offset)

    def _train_function(self, state, iterator):
        return self._batches(self._train_batch, state, iterator)

    def _train_batch(self, state, data):
        if self.shards is not None:  # an optimizer in parts: the state of this rank's part only
            self.see_optimizers()
            state = (state[0], state[1], self.shards.before_step(self.model.optimizer, state[2]), state[3])
        self._state = state
        try:
            return self.driver.train(data, self._train_on)
        finally:
            self._state = self._kept = None

    # The driver's hooks: JAX's state is values, so what a step changes is the state it starts from.
    def snapshot(self) -> tuple:
        """Copies of the non-trainable and metric states (the step's function donates them)."""
        _, non_trainable, _, metrics = self._state
        self._kept = jax.tree.map(jnp.copy, (non_trainable, metrics))
        return self._kept

    def restore_forward(self, kept: tuple | None) -> None:
        if kept is not None:
            trainable, _, optimizer, _ = self._state
            self._state = (trainable, kept[0], optimizer, kept[1])

    def restore_metrics(self) -> None:
        """The metric states came back with :meth:`restore_forward`."""

    def _train_on(self, data, plan):
        """One attempt at a training step from ``self._state``; returns ``(logs, new state)``."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        state = self._state
        self._fresh = None
        if self.user_train_step is not None:
            logs, new_state, self._fresh = self.eager.train(state, data, plan)
            return logs, new_state
        trainable, non_trainable, optimizer, metrics = state
        self._compiled = False
        self.timing.begin()
        weight = np.float32(plan.weight)
        if self.comm.alone and plan.local > 0 and self.half is None and self._kept is None:
            return self._train_alone(state, x, y, sample_weight, weight, plan)
        if self.exchange is not None:
            self.exchange.begin_step(plan.weight, plan.local > 0)
        if plan.local > 0:
            vector, non_trainable, metrics = self._local_vector(trainable, non_trainable, metrics, optimizer, x, y,
                                                                sample_weight, weight, plan.local)
        elif self.exchange is not None:
            vector, non_trainable = self._timed_first(
                "idle", 0, lambda: self._idle_exchanging(trainable, non_trainable, metrics, x, weight,
                                                         self._message()))
        else:
            vector = self._timed_first("idle", 0, lambda: self._idle(metrics, self._message()))
        jax.block_until_ready(vector)  # JAX runs asynchronously: computing is not waiting for the others
        with self.timing.waiting():
            if self.half is None:
                summed = self.comm.reduce(vector, "summing gradients")
            else:
                grads, rest = (self.comm.reduce(part, "summing gradients") for part in vector)
                summed = np.concatenate([grads.astype(np.float32), rest])
        if self.exchange is not None:
            self.exchange.end_step()  # every rank is past its exchanges: it took part in the sum
        self.driver.heard(summed[self._n_grads + self._n_states :])  # a rank that ran out: none applies it
        if not self._applied:  # the first step compiles the update too: not a measurement of the shares
            self._applied = self._compiled = True
        trainable, optimizer, logs = self._apply(trainable, optimizer, summed)
        if self.shards is not None:  # the owners' new weights on every rank
            trainable = self.shards.share(self.model.optimizer, self._trainable_refs, trainable)
        self.driver.finish(summed[self._n_grads + self._n_states :])
        self.driver.done(plan, measured=not self._compiled)  # a step that compiled: not timed
        return logs, (trainable, non_trainable, optimizer, metrics)

    # Devices set aside (multigpu/backend/parking.py): the rank left sums over itself (its comm is alone).
    def _train_alone(self, state, x, y, sample_weight, weight, plan):
        """A step of the one rank left (the others set aside; no memory bound, no compression): one compiled
        function, as one device's step in plain Keras."""
        trainable, non_trainable, optimizer, metrics = state
        message = self._message()
        out = self._timed_first("alone", plan.local, lambda: self._alone(
            trainable, non_trainable, metrics, optimizer, x, y, sample_weight, weight, message))
        trainable, optimizer, non_trainable, metrics, logs, tail = out
        # JAX computes while Python goes on, as in Keras's own loop: this step waits for the one before it only,
        # so that the host's work for the next step overlaps this one's compute (the time between two step ends
        # stays a step's). Its summed message is its own, which the function passed through.
        if self._ahead is not None:
            jax.block_until_ready(self._ahead)
        self._ahead = tail
        self.driver.heard(message)
        self.driver.finish(message)
        self.driver.done(plan, measured=not self._compiled)
        return logs, (trainable, non_trainable, optimizer, metrics)

    def can_set_aside(self) -> bool:
        """Not with the optimizer state in parts: its parts live in the compiled step's state, which Keras passes
        through ``fit`` (they would not move to the rank left)."""
        return not self.parallel.options.shard_optimizer

    def stand_still(self, logs):
        """A step set aside: ``logs``, and the state as Keras passed it in (nothing changed)."""
        return logs, self._state

    def logs_in(self, result):
        return result[0]  # (logs, state)

    def forget_results(self) -> None:
        self._fresh = None

    def _message(self, short: int = 0, cap: int = 0) -> np.ndarray:
        """This rank's step message (:meth:`StepDriver.say <multigpu.backend.driver.StepDriver.say>`), float32."""
        return np.asarray(self.driver.say(short, cap), np.float32)

    def _local_vector(self, trainable, non_trainable, metrics, optimizer, x, y, sample_weight, weight, rows: int):
        """This rank's part of the sum on its ``rows`` rows: ``(vector, non-trainable, metric states)``; a rank
        that ran out of memory sends what a rank with no rows sends, and says so in its message."""
        def run():
            out = self._timed_first("train", rows, lambda: self._local(trainable, non_trainable, metrics, optimizer,
                                                                     x, y, sample_weight, weight, self._message()))
            return jax.block_until_ready(out)

        # (global BatchNorm statistics: the other ranks would wait in an exchange this rank left)
        out, short, cap = self.driver.local(rows, run, self.memory.release,
                                            may_retry=self._kept is not None and self.exchange is None)
        if short:
            non_trainable, metrics = self._kept  # the failed call may have taken the donated ones
            return self._idle(metrics, self._message(short=rows)), non_trainable, metrics
        vector, non_trainable, metrics = out
        if cap:  # a measured step (a few per local batch size): the cap into its slot of the message
            at = self._n_states + self.driver.message.sections["cap"][0] + self.comm.rank
            if self.half is None:
                vector = vector.at[self._n_grads + at].set(cap)
            else:
                vector = (vector[0], vector[1].at[at].set(cap))
        return vector, non_trainable, metrics

    def _solo_rate(self, data, rows: int) -> tuple[float, float]:
        """Samples/s of this rank's share of the step alone (compiling first, untimed).

        It times the step's own compiled local function on copies of the
        state, so that the compilation serves the first step too.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        trainable, non_trainable, optimizer, metrics = self._state
        weight, tail = np.float32(1.0), self._message()

        def call():
            copies = [jax.tree.map(jnp.copy, v) for v in (non_trainable, metrics)]  # the function donates them
            return self._local(trainable, *copies, optimizer, x, y, sample_weight, weight, tail)

        with self.exchange.alone() if self.exchange is not None else nullcontext():  # each rank times itself
            return time_alone(lambda: jax.block_until_ready(call()), rows,
                              first=lambda: self._timed_first("train", rows, call))
