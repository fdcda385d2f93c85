"""A ``train_step`` or ``test_step`` of the model's own on JAX (the stateless style), run eagerly.

Each ``optimizer.stateless_apply`` the step calls applies the gradients times
``b_r / B`` summed over ranks (one collective per call, so a GAN's two
optimizers work), and the step's logs become global in one collective after
it: metrics from summed states, other scalars as rows-weighted means; the
step timings travel in the same collective (training only).

A rank with no rows runs the step on its last batch (before its first rows,
on one row of zeros) with gradient weight 0, so that it makes the same
optimizer calls and logs the same names as the others; it sends zeros and
keeps its non-trainable and metric states as they were.
"""

from __future__ import annotations

from contextlib import contextmanager

import jax
import jax.numpy as jnp
import keras
import numpy as np

from multigpu._keras.model_parts import optimizers_of
from multigpu.backend.jax.packing import flat, metric_results, one_row_of_zeros, split
from multigpu.balancing.timing import StepRecord

__all__ = ["EagerSteps"]


class EagerSteps:
    """The model's own ``train_step``/``test_step``, eagerly, with sums over ranks.

    Args:
        steps: the model's :class:`~multigpu.backend.jax.step.JaxSteps` (its model, collectives, timing,
            balancer, compression and BatchNorm exchange are read from it).
    """

    def __init__(self, steps) -> None:
        self.model = steps.model
        self.comm = steps.comm
        self.timing = steps.timing
        self.balancer = steps.balancer
        self.half = steps.half
        self.exchange = steps.exchange
        self.user_train_step = steps.user_train_step
        self.user_test_step = steps.user_test_step
        self.keras_metrics_result = keras.Model.get_metrics_result.__get__(self.model)
        self._last_batch = None  # the last batch with rows, for the steps where this rank has none
        self._last_test_batch = None

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
        with self._summed_optimizers(0.0 if idle else plan.weight):
            logs, new_state = self.user_train_step(self.model, state, self._last_batch if idle else data)
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

    @contextmanager
    def _summed_optimizers(self, weight: float):
        """Within the block, every optimizer's ``stateless_apply`` applies the weighted gradients summed over
        ranks (one collective per call)."""
        patched = []
        for optimizer in optimizers_of(self.model):
            original = optimizer.stateless_apply

            def summed_apply(optimizer_variables, grads, trainable_variables, _original=original):
                if weight == 0:  # no rows here: zeros, whatever the step computed on its stand-in batch (NaN)
                    vector = jnp.zeros(sum(int(np.prod(g.shape)) for g in grads), jnp.float32)
                else:
                    vector = jnp.concatenate([jnp.zeros(0, jnp.float32), *(g * weight for g in flat(grads))])
                vector = jax.block_until_ready(vector if self.half is None else vector.astype(self.half))
                with self.timing.waiting():
                    summed = self.comm.reduce(vector, "summing gradients").astype(np.float32, copy=False)
                return _original(optimizer_variables, split(jnp.asarray(summed), list(grads)), trainable_variables)

            object.__setattr__(optimizer, "stateless_apply", summed_apply)
            patched.append(optimizer)
        try:
            yield
        finally:
            for optimizer in patched:
                object.__delattr__(optimizer, "stateless_apply")

    def _global_logs(self, logs: dict, metrics: list, rows: int, timing: bool = True) -> tuple[dict, dict]:
        """The step's logs over every rank, and every global metric result."""
        refs = list(self.model.metrics_variables)
        with keras.StatelessScope(state_mapping=list(zip(refs, metrics))):
            names = set(self.keras_metrics_result())
        extra = [k for k in logs if k not in names]
        for k in extra:
            if np.size(logs[k]) != 1:
                raise ValueError(f"multigpu: the step logged {k!r} with shape {tuple(np.shape(logs[k]))}; logs must "
                                 "be metrics (in model.metrics) or scalars, so that every rank can show the global "
                                 "value.")
        timings = self.timing.vector() if timing else []
        tail = np.asarray([*(float(logs[k]) * rows for k in extra), float(rows), *timings], np.float32)
        n_states = sum(int(np.prod(v.shape)) for v in refs)
        summed = self.comm.reduce(jnp.concatenate([jnp.zeros(0, jnp.float32), *flat(metrics), jnp.asarray(tail)]),
                                  "summing the step's logs")
        out = dict(metric_results(self.model, jnp.asarray(summed), refs, 0))
        total = float(summed[n_states + len(extra)])
        for i, k in enumerate(extra):
            out[k] = float(summed[n_states + i]) / total if total else 0.0
        if timing:
            self.balancer.record(StepRecord.from_vector([float(v) for v in summed[n_states + len(extra) + 1 :]],
                                                        self.comm.world_size, complete=True))
        return {k: out[k] for k in logs if k in out}, out
