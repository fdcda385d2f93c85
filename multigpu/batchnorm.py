"""BatchNormalization across devices.

Default: each device normalises over its own share, and the moving mean and
variance are averaged over ranks, weighted by share, at every epoch end and
before ``evaluate``/``predict`` (:meth:`ParallelState.sync_batchnorm_statistics`).

``parallelize(..., sync_batchnorm=True)``: the batch statistics of every
``BatchNormalization`` layer are computed over the whole global batch.  Each
rank sums its rows and squared rows and a differentiable all-reduce adds them
up, so the forward pass equals one device's on the whole batch, and the
backward pass sends each rank's gradient of the statistics to every rank.  For
that to be exact each rank back-propagates its loss already weighted by its
share (see ``ParallelState.train_step``).
"""

from __future__ import annotations

import warnings

import keras
import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

__all__ = ["batchnorm_layers", "install_global_moments"]


def batchnorm_layers(model) -> list:
    """Every ``BatchNormalization`` layer of ``model``, nested ones included."""
    return [
        layer for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def _global_moments(layer):
    local_moments = layer._moments
    warned = []

    def moments(inputs, mask):
        if mask is not None or getattr(layer, "renorm", False):
            if not warned:
                warned.append(True)
                warnings.warn(
                    f"sync_batchnorm: layer {layer.name!r} has a mask or renorm; it uses "
                    "each device's own statistics.",
                    stacklevel=2,
                )
            return local_moments(inputs, mask)
        x = inputs
        axes = list(layer._reduction_axes)
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


def install_global_moments(model) -> int:
    """Makes every BatchNormalization layer of ``model`` use global statistics.

    Returns:
        The number of layers changed.
    """
    layers = batchnorm_layers(model)
    for layer in layers:
        object.__setattr__(layer, "_moments", _global_moments(layer))
    return len(layers)
