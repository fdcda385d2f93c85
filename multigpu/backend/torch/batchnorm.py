"""BatchNormalization across devices.

Default: each device normalises over its own share, and the moving mean and
variance are averaged over ranks, weighted by share, at every epoch end and
before ``evaluate``/``predict`` (:func:`average_statistics`).

``parallelize(..., sync_batchnorm=True)``: the batch statistics of every
``BatchNormalization`` layer are computed over the whole global batch.  Each
rank sums its rows and squared rows and a differentiable all-reduce adds them
up, so the forward pass equals one device's on the whole batch, and the
backward pass sends each rank's gradient of the statistics to every rank.  For
that to be exact each rank back-propagates its loss already weighted by its
share (the training step does, see :mod:`multigpu.backend.torch.step`).
The layer's private ``_moments`` and ``_reduction_axes`` are reached only
through :mod:`multigpu._keras.compat` (Keras's own
``synchronized=True`` raises on torch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import batchnorm_statistics, use_global_batchnorm

__all__ = ["average_statistics", "install_global_moments"]


def average_statistics(model, comm, weight: float) -> None:
    """Replaces every BatchNorm moving statistic by ``sum_r weight_r * value_r`` over ranks."""
    variables = batchnorm_statistics(model)
    if not variables:
        return
    values = [v.value.detach() for v in variables]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in values]) * weight
    with comm.fatal("averaging BatchNorm statistics"):
        dist.all_reduce(flat)
    offset = 0
    with torch.no_grad():
        for v, t in zip(variables, values):
            v.value.copy_(flat[offset : offset + t.numel()].view(t.shape).to(t.dtype))
            offset += t.numel()


def _global_moments(layer, index: int):
    del index  # torch's collectives pair calls by their order, the same on every rank

    def moments(x):
        axes = _compat.batchnorm_axes(layer)
        count = 1
        for a in axes:
            count *= x.shape[a]
        total = torch.sum(x, dim=axes, keepdim=True)
        squares = torch.sum(x * x, dim=axes, keepdim=True)
        n = total.numel()
        packed = torch.cat([
            total.reshape(-1), squares.reshape(-1),
            torch.full((1,), float(count), dtype=x.dtype, device=x.device),
        ])
        packed = differentiable_all_reduce(packed, op=dist.ReduceOp.SUM)
        rows = packed[-1]
        mean = packed[:n].view(total.shape) / rows
        variance = packed[n : 2 * n].view(total.shape) / rows - mean * mean
        return torch.squeeze(mean, axes), torch.squeeze(variance, axes)

    return moments


def install_global_moments(model, ledger) -> int:
    """Makes every BatchNormalization layer of ``model`` use global statistics.

    Returns:
        The number of layers changed.
    """
    return use_global_batchnorm(model, _global_moments, ledger)
