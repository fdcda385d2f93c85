"""The logs of a step of the model's own, over every rank: what the JAX and TensorFlow backends share.

A ``train_step`` or ``test_step`` of the model's own returns logs: Keras
metrics (whose states are summed over ranks and read again) and other
scalars (a GAN's two losses), which become rows-weighted means.  Both travel
in one sum with the step's timings: the metric states first, then each other
scalar times this rank's rows, the rows, and the timings (training only).

A rank with no rows runs the step on its last batch (before its first rows,
on one row of zeros) with gradient weight 0, so that it makes the same
optimizer calls and logs the same names as the others; it sends zeros and
puts its non-trainable and metric states back as they were.

A step's first sum also carries the memory word
(:meth:`~multigpu.balancing.caps.DeviceMemory.word`), so that a step that ran
out of memory before it is taken again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from multigpu.balancing.timing import StepRecord

__all__ = ["other_scalars", "read_summed"]


def other_scalars(logs: Mapping, metric_names, rows: int, timings: Sequence[float] = ()) -> tuple[list, np.ndarray]:
    """The logs that are not metrics, and the tail of the step's sum: each times ``rows``, the rows, the timings.

    Raises:
        ValueError: a log that is neither a metric of the model nor a scalar (every rank could not show it).
    """
    extra = [k for k in logs if k not in metric_names]
    for k in extra:
        if np.size(logs[k]) != 1:
            raise ValueError(f"multigpu: the step logged {k!r} with shape {tuple(np.shape(logs[k]))}; logs must "
                             "be metrics (in model.metrics) or scalars, so that every rank can show the global "
                             "value.")
    tail = np.asarray([*(float(np.reshape(logs[k], ())) * rows for k in extra), float(rows), *timings], np.float32)
    return extra, tail


def read_summed(logs: Mapping, summed, n_states: int, extra: list, metrics: Mapping, balancer=None,
                world_size: int = 0) -> tuple[dict, dict]:
    """The step's logs over every rank and every global result, from the sum :func:`other_scalars` built.

    Args:
        logs: the step's own logs (their names, in their order).
        summed: the sum over ranks: ``n_states`` metric states, then the tail.
        n_states: how many values the metric states take.
        extra: the logs that are not metrics (from :func:`other_scalars`).
        metrics: the metrics' results, read from the summed states.
        balancer: the model's balancer, which reads the step's timings (training), or None.
        world_size: the run's ranks (with ``balancer``).
    """
    out = dict(metrics)
    total = float(summed[n_states + len(extra)])
    for i, k in enumerate(extra):
        out[k] = float(summed[n_states + i]) / total if total else 0.0
    if balancer is not None:
        balancer.record(StepRecord.from_vector([float(v) for v in summed[n_states + len(extra) + 1 :]],
                                               world_size, complete=True))
    return {k: out[k] for k in logs if k in out}, out
