"""BatchNormalization across devices on JAX: global batch statistics (``sync_batchnorm=True``).

Each rank's training step is a program of its own (ranks hold different row
counts, so XLA compiles one per local batch size), and XLA's collectives need
the same program on every rank: the statistics cannot be summed by an XLA
all-reduce inside the step.  They are summed on the host instead, through the
key-value store of ``jax.distributed``'s coordination service (the run's own
rendezvous, on every machine of the run), from an ``io_callback`` inside the
compiled step.  A callback never calls into JAX, so it cannot deadlock XLA.

Forward: each ``BatchNormalization`` layer sums its rows, its squared rows
(both about a shift, see below) and its row count, and :class:`StatisticsExchange`
adds the vectors of every rank in rank order, so every rank normalises with
the statistics of the whole global batch, bit-identical on every rank.

Backward: the cotangent of the summed statistics on rank ``q`` is ``g_q`` (the
derivative of its own, unweighted, loss).  The global loss is
``sum_q w_q L_q`` (``w_q = b_q / B``), so each rank's statistics get the
cotangent ``sum_q w_q g_q``.  The step multiplies each rank's gradients by its
``w_r`` afterwards (the same weighting as without global statistics), so the
exchange hands back ``sum_q w_q g_q / w_r``: after the step's weighting, the
sum over ranks is the single-device gradient of the whole batch.  A rank with
no rows sends zeros both ways and gets zeros back.

The variance is ``E[(x - K)^2] - (E[x] - K)^2`` with ``K`` the layer's moving
mean (the same on every rank, not differentiated): once the moving mean
follows the data, the one-pass formula does not cancel.

Keys are ``multigpu/bn/<rank>/<layer>:<direction>:<count>``, and the count
pairs the calls of the ranks.  Each exchange blocks until every rank has sent
its part, so every rank must make its calls in the same order: the callbacks
are *ordered* (JAX runs them in program order, the same on every rank).
Unordered, XLA may run two layers' callbacks in either order where nothing
links them (a rank with no rows: its statistics are zeros whatever the
layer's input), and two ranks that wait on each other's other layer never
return.  A rank deletes its own keys after the step's gradient sum (every
rank has read them by then).
"""

from __future__ import annotations

from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import use_global_batchnorm

__all__ = ["StatisticsExchange", "install_global_moments"]

PREFIX = "multigpu/bn"


class StatisticsExchange:
    """Sums vectors over ranks from inside a compiled step (host callbacks over the coordination service).

    Args:
        client: ``jax.distributed``'s client (``key_value_set_bytes``, ``blocking_key_value_get_bytes``,
            ``key_value_delete``).
        rank: this process's rank.
        world_size: the number of ranks.
        timeout: seconds to wait for another rank's vector before the step fails.
    """

    def __init__(self, client, rank: int, world_size: int, timeout: float) -> None:
        self.client = client
        self.rank = rank
        self.world_size = world_size
        self.timeout_ms = max(1000, int(timeout * 1000))
        self.weight = 1.0  # w_r = b_r / B of the step running now
        self.contributes = True  # False on a rank with no rows (a custom step runs on its last batch)
        self.solo = False  # calibration: this rank's own statistics, no exchange
        self._counts: dict[str, int] = {}
        self.exchanges = 0  # vectors exchanged since the start

    # ---------------------------------------------------------- per step
    def begin_step(self, weight: float, contributes: bool) -> None:
        """The weight and the role of this rank in the step that begins."""
        self.weight = float(weight)
        self.contributes = bool(contributes)

    def end_step(self) -> None:
        """Deletes this rank's keys.  Call only after a collective that follows every rank's exchanges."""
        self.client.key_value_delete(f"{PREFIX}/{self.rank}")

    @contextmanager
    def alone(self):
        """Within the block each rank uses its own statistics (calibration's solo timing)."""
        self.solo = True
        try:
            yield
        finally:
            self.solo = False

    # ---------------------------------------------------------- the sum
    def _sum(self, tag: str, vector: np.ndarray) -> np.ndarray:
        count = self._counts.get(tag, 0)
        self._counts[tag] = count + 1
        name = f"{tag}:{count}"
        mine = np.ascontiguousarray(vector, dtype=np.float32)
        self.client.key_value_set_bytes(f"{PREFIX}/{self.rank}/{name}", mine.tobytes())
        total = np.zeros(mine.shape, np.float64)
        for q in range(self.world_size):  # rank order: the same sum, bit for bit, on every rank
            if q == self.rank:
                part = mine
            else:
                raw = self.client.blocking_key_value_get_bytes(f"{PREFIX}/{q}/{name}", self.timeout_ms)
                part = np.frombuffer(raw, np.float32).reshape(mine.shape)
            total += part
        self.exchanges += 1
        return total.astype(np.float32)

    def forward(self, tag: str, vector: np.ndarray) -> np.ndarray:
        """The sum over ranks of every rank's statistics (a rank with no rows sends zeros)."""
        vector = np.asarray(vector, np.float32)
        if self.solo:
            return vector
        return self._sum(f"{tag}:f", vector if self.contributes else np.zeros_like(vector))

    def backward(self, tag: str, cotangent: np.ndarray) -> np.ndarray:
        """``sum_q w_q g_q / w_r``: see the module docstring."""
        cotangent = np.asarray(cotangent, np.float32)
        if self.solo:
            return cotangent
        weight = self.weight if self.contributes else 0.0
        total = self._sum(f"{tag}:b", cotangent * np.float32(weight))
        return total / np.float32(weight) if weight > 0 else np.zeros_like(total)

    # ---------------------------------------------------------- traced
    def summed(self, tag: str):
        """A differentiable function ``vector -> sum over ranks`` for JAX code (jitted or not)."""

        def call(method, vector):
            shape = jax.ShapeDtypeStruct(vector.shape, jnp.float32)
            return io_callback(lambda v: method(tag, v), shape, vector.astype(jnp.float32), ordered=True)

        @jax.custom_vjp
        def allsum(vector):
            return call(self.forward, vector)

        def fwd(vector):  # the callback itself, not allsum: jax < 0.5 would differentiate allsum's callback here
            return call(self.forward, vector), None

        def bwd(_, cotangent):
            return (call(self.backward, cotangent),)

        allsum.defvjp(fwd, bwd)
        return allsum


def _global_moments(exchange: StatisticsExchange):
    def for_layer(layer, index: int):
        allsum = exchange.summed(str(index))

        def moments(inputs):
            axes = tuple(_compat.batchnorm_axes(layer))
            x = inputs.astype(jnp.float32)
            shift = jax.lax.stop_gradient(jnp.asarray(layer.moving_mean.value, jnp.float32))
            shift = jnp.reshape(shift, [1 if a in axes else x.shape[a] for a in range(x.ndim)])
            centred = x - shift
            rows = 1
            for a in axes:
                rows *= x.shape[a]
            total = jnp.sum(centred, axis=axes)
            squares = jnp.sum(centred * centred, axis=axes)
            n = total.size
            packed = allsum(jnp.concatenate([total.reshape(-1), squares.reshape(-1),
                                             jnp.full((1,), rows, jnp.float32)]))
            count = packed[-1]
            shifted_mean = packed[:n].reshape(total.shape) / count
            variance = packed[n : 2 * n].reshape(total.shape) / count - shifted_mean * shifted_mean
            mean = shifted_mean + jnp.squeeze(shift, axes)
            return mean.astype(inputs.dtype), jnp.maximum(variance, 0.0).astype(inputs.dtype)

        return moments

    return for_layer


def install_global_moments(model, exchange: StatisticsExchange, ledger) -> int:
    """Makes every ``BatchNormalization`` layer of ``model`` normalise with the global batch's statistics.

    Returns:
        The number of layers changed.
    """
    return use_global_batchnorm(model, _global_moments(exchange), ledger)
