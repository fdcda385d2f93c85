"""Collectives: share-weighted gradient sync and global metrics.

The combined gradient of a step is ``sum_r (b_r / B) * g_r`` where ``g_r`` is
the gradient of rank ``r``'s mean loss over its ``b_r`` samples and ``B`` the
global batch of the step.  That is exactly the gradient of the mean loss over
the global batch.  It is computed by torch's DDP reducer (bucketed, overlapped
with the backward pass) with a comm hook that scales each bucket by the local
weight ``b_r / B`` and sums; plain DDP would divide by the number of ranks,
which is wrong whenever shares differ.

Steps in which some rank has no samples (a ragged last batch) cannot go
through DDP (the empty rank runs no backward pass), so they use one flat
all-reduce in which the empty rank contributes zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "WeightedGradSync",
    "average_variables",
    "check_same_on_every_rank",
    "exchange_sizes",
    "global_metric_states",
]


class _HookState:
    """Per-step state read by the comm hook."""

    def __init__(self) -> None:
        self.weight = 1.0


def _weighted_sum_hook(state: _HookState, bucket) -> torch.futures.Future:
    buffer = bucket.buffer()
    if state.weight != 1.0:
        buffer.mul_(state.weight)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks the real annotation, which `from __future__ import annotations`
# would turn into a string.
_weighted_sum_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def exchange_sizes(local_size: int, world_size: int, device: torch.device) -> list[int]:
    """Every rank's local batch size for this step (one small all-reduce)."""
    sizes = torch.zeros(world_size, dtype=torch.int64, device=device)
    sizes[dist.get_rank()] = local_size
    dist.all_reduce(sizes)
    return [int(s) for s in sizes.tolist()]


def check_same_on_every_rank(value: int, what: str, device: torch.device) -> None:
    """Raises on every rank when ranks disagree on ``value`` (one all-gather).

    Used for data lengths: ranks that disagree would take different numbers
    of steps and wait for each other until the timeout.
    """
    world = dist.get_world_size()
    values = torch.zeros(world, dtype=torch.int64, device=device)
    values[dist.get_rank()] = int(value)
    dist.all_reduce(values)
    got = [int(v) for v in values.tolist()]
    if len(set(got)) > 1:
        detail = ", ".join(f"rank {r}: {v}" for r, v in enumerate(got))
        raise ValueError(
            f"The ranks received different data: {what} differ ({detail}). Every rank must "
            "see the same data (build or load it the same way on every rank)."
        )


class WeightedGradSync:
    """Wraps a built Keras model in DDP with a share-weighting comm hook.

    Args:
        model: the user's Keras model (a ``torch.nn.Module``), built.
        device: this rank's torch device.
        bucket_cap_mb: DDP bucket size.
    """

    def __init__(self, model, device: torch.device, bucket_cap_mb: float = 25.0) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.state = _HookState()
        self.model = model
        device_ids = [device.index] if device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters (trainable and not) on creation,
        # so every rank starts from the same weights.
        self.ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=bucket_cap_mb,
        )
        self.ddp.register_comm_hook(self.state, _weighted_sum_hook)

    def forward(self, *args, **kwargs):
        """Runs the model's forward pass through DDP (arms the reducer)."""
        return self.ddp(*args, **kwargs)

    @staticmethod
    def manual_allreduce(variables: Sequence, weight: float) -> list[torch.Tensor]:
        """Sums ``weight * grad`` over ranks in one flat all-reduce.

        Used for steps in which some rank has no samples; a variable without
        a gradient contributes zeros.
        """
        grads = []
        for v in variables:
            g = v.value.grad
            grads.append(torch.zeros_like(v.value) if g is None else g)
        if not grads:
            return []
        flat = torch.cat([g.reshape(-1) for g in grads]) * weight
        dist.all_reduce(flat)
        out, offset = [], 0
        for g in grads:
            n = g.numel()
            out.append(flat[offset : offset + n].view_as(g))
            offset += n
        return out


def _metric_variables(model) -> list:
    seen, out = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


class global_metric_states:  # noqa: N801 - used as a context manager
    """Within the block, every metric variable holds its sum over ranks.

    Metric states are sums and counts, so summing them over ranks and then
    calling ``result()`` gives the metric over the global batch, weighted by
    samples.  The local states are restored on exit, so that the next step
    keeps accumulating locally.
    """

    def __init__(self, model) -> None:
        self.variables = _metric_variables(model)
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> global_metric_states:
        if not self.variables:
            return self
        self.saved = [v.value.detach().clone() for v in self.variables]
        flat = torch.cat([s.reshape(-1).to(torch.float64) for s in self.saved])
        dist.all_reduce(flat)
        offset = 0
        with torch.no_grad():
            for v, s in zip(self.variables, self.saved):
                n = s.numel()
                part = flat[offset : offset + n].view(s.shape)
                if not s.dtype.is_floating_point:
                    part = part.round()
                v.value.copy_(part.to(s.dtype))
                offset += n
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for v, s in zip(self.variables, self.saved):
                v.value.copy_(s)


def average_variables(variables: Sequence, weight: float) -> None:
    """Replaces each variable by ``sum_r weight_r * value_r`` over ranks."""
    if not variables:
        return
    values = [v.value.detach() for v in variables]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in values]) * weight
    dist.all_reduce(flat)
    offset = 0
    with torch.no_grad():
        for v, t in zip(variables, values):
            n = t.numel()
            v.value.copy_(flat[offset : offset + n].view(t.shape).to(t.dtype))
            offset += n
