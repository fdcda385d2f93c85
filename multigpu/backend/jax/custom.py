"""A ``train_step`` or ``test_step`` of the model's own on JAX (the stateless style), run eagerly.

Each ``optimizer.stateless_apply`` the step calls applies the gradients times
``b_r / B`` summed over ranks (one collective per call, so a GAN's two
optimizers work): set once per optimizer through the model's ledger (so
``unparallelize`` gives each its own back), it is the optimizer's own outside
a step of the model's.  The step's logs become global in one collective after
it: metrics from summed states, other scalars as rows-weighted means; the
step timings travel in the same collective (training only).

A rank with no rows, and the memory word a step's first sum carries:
:mod:`multigpu.backend.logs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np

from multigpu import membership
from multigpu._keras.compat import optimizer_variables as optimizer_variables_of
from multigpu._keras.model_parts import optimizers_of
from multigpu.backend.jax.packing import flat, metric_results, one_row_of_zeros, split
from multigpu.backend.logs import other_scalars, read_summed
from multigpu.backend.sharding import holder
from multigpu.balancing.caps import OutOfMemoryStepError, is_out_of_memory

__all__ = ["EagerSteps"]


class EagerSteps:
    """The model's own ``train_step``/``test_step``, eagerly, with sums over ranks.

    Args:
        steps: the model's :class:`~multigpu.backend.jax.step.JaxSteps` (its model, collectives, timing,
            balancer, compression and BatchNorm exchange are read from it).
    """

    def __init__(self, steps) -> None:
        self.steps = steps
        self.model = steps.model
        self.comm = steps.comm
        self.timing = steps.timing
        self.balancer = steps.balancer
        self.half = steps.half
        self.exchange = steps.exchange
        self.user_train_step = steps.user_train_step
        self.user_test_step = steps.user_test_step
        self._last_batch = None  # the last batch with rows, for the steps where this rank has none
        self._last_test_batch = None
        self.ledger = steps.parallel.ledger
        self._weight: float | None = None  # the step's gradient weight while a step of the model's own runs
        self._word = False  # the running step's next sum carries the memory word
        self._first = None  # the length of a step's first gradient sum (a rank that ran out sends as much)

    def train(self, state, data, plan) -> tuple[dict, tuple, dict]:
        """One training step; returns its logs, the new state and the global results."""
        idle = plan.local == 0
        if not idle:
            self._last_batch = data
        elif self._last_batch is None:
            self._last_batch = one_row_of_zeros(data)
        self.timing.begin()
        if self.exchange is not None:
            self.exchange.begin_step(plan.weight, not idle)
        self._install()
        self._weight = 0.0 if idle else plan.weight
        self._word = True
        try:
            if not idle:
                membership.fault_out_of_memory(self.comm.rank)
            logs, new_state = self.user_train_step(self.model, state, self._last_batch if idle else data)
        except Exception as exc:
            if (idle or isinstance(exc, OutOfMemoryStepError) or not self.steps.memory.bounded or not self._word
                    or not is_out_of_memory(exc)):
                raise  # (after its first sum, a step that ran out ends the run: some updates were applied)
            self._ran_out(plan.local)
        finally:
            self._weight = None
        if idle and self.exchange is None:
            new_state = (new_state[0], state[1], new_state[2], state[3])
        elif idle:  # the moving statistics follow the global batch, as on the other ranks
            new_state = (new_state[0], new_state[1], new_state[2], state[3])
        logs, fresh = self._global_logs(logs, new_state[3], 0 if idle else plan.local)
        if self.exchange is not None:
            self.exchange.end_step()
        self.timing.end(plan.local)
        return logs, new_state, fresh

    def test(self, state, data, rows: int) -> tuple[dict, tuple, dict]:
        """One test step; returns its logs, the new state and the global results."""
        if rows > 0:
            self._last_test_batch = data
        elif self._last_test_batch is None:
            self._last_test_batch = one_row_of_zeros(data)
        logs, new_state = self.user_test_step(self.model, state, data if rows > 0 else self._last_test_batch)
        if rows == 0:
            new_state = state
        logs, fresh = self._global_logs(logs, new_state[2], rows, timing=False)
        return logs, new_state, fresh

    def _install(self) -> None:
        """Every optimizer's ``stateless_apply`` (once each, through the model's ledger) applies the weighted
        gradients summed over ranks while a step of the model's own runs, and is the optimizer's own otherwise."""
        for optimizer in optimizers_of(self.model):
            if not self.ledger.owns(optimizer, "stateless_apply"):
                self.ledger.set(optimizer, "stateless_apply", self._summed_apply(optimizer, optimizer.stateless_apply))

    def _sum(self, vector) -> np.ndarray:
        """The sum of a weighted gradient vector over ranks; the step's first carries the memory word (which
        raises on every rank where one ran out)."""
        word = self._word
        if word:
            self._word = False
            self._first = int(vector.shape[0])
            vector = jnp.concatenate([vector, jnp.asarray(self.steps.memory.word(), vector.dtype)])
        vector = jax.block_until_ready(vector if self.half is None else vector.astype(self.half))
        with self.timing.waiting():
            summed = self.comm.reduce(vector, "summing gradients").astype(np.float32, copy=False)
        if word:
            self.steps.memory.read_word(summed[self._first :])
            summed = summed[: self._first]
        return summed

    def _ran_out(self, rows: int) -> None:
        """This rank's step ran out of memory before its first sum (:meth:`DeviceMemory.ran_out
        <multigpu.balancing.caps.DeviceMemory.ran_out>`)."""
        self.steps.memory.ran_out(rows, self._first, self.model.trainable_variables,
                                  lambda v: self.comm.reduce(v, "summing gradients"), self.half or np.float32)

    def _summed_apply(self, optimizer, original):
        def stateless_apply(optimizer_variables, grads, trainable_variables):
            weight = self._weight
            if weight is None:
                return original(optimizer_variables, grads, trainable_variables)
            if weight == 0:  # no rows here: zeros, whatever the step computed on its stand-in batch (NaN)
                vector = jnp.zeros(sum(int(np.prod(g.shape)) for g in grads), jnp.float32)
            else:
                vector = jnp.concatenate([jnp.zeros(0, jnp.float32), *(g * weight for g in flat(grads))])
            summed = self._sum(vector)
            trainable, state = original(optimizer_variables, split(jnp.asarray(summed), list(grads)),
                                        trainable_variables)
            shards = self.steps.shards
            if shards is not None:  # an optimizer in parts: the owners' new weights on every rank
                trainable = shards.share(optimizer, optimizer_variables_of(holder(optimizer)), trainable)
            return trainable, state

        return stateless_apply

    def _global_logs(self, logs: dict, metrics: list, rows: int, timing: bool = True) -> tuple[dict, dict]:
        """The step's logs over every rank, and every global metric result (:mod:`multigpu.backend.logs`)."""
        refs = list(self.model.metrics_variables)
        with keras.StatelessScope(state_mapping=list(zip(refs, metrics))):
            names = set(self.steps.keras_metrics_result())
        extra, tail = other_scalars(logs, names, rows, self.timing.vector() if timing else ())
        n_states = sum(int(np.prod(v.shape)) for v in refs)
        summed = self.comm.reduce(jnp.concatenate([jnp.zeros(0, jnp.float32), *flat(metrics), jnp.asarray(tail)]),
                                  "summing the step's logs")
        results = metric_results(self.model, jnp.asarray(summed), refs, 0)
        return read_summed(logs, summed, n_states, extra, results, self.balancer if timing else None,
                           self.comm.world_size)
