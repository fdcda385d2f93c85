"""The optimizer's state in parts on torch: its storage and its collective (the rest is
:mod:`multigpu.backend.sharding`).

A state variable this rank does not own keeps its Keras shape over a
``torch.nn.Parameter`` of no elements.  The new weights, and the whole state
when it is gathered, reach every rank in one collective per dtype whose every
element one rank writes: on shared memory each owner writes its values
straight into the result, which nobody adds up; elsewhere (gloo between
machines, NCCL on GPUs) a sum of vectors that are zero where a rank does not
own.
"""

from __future__ import annotations

import torch

from multigpu._keras import compat as _compat
from multigpu.backend.sharding import Shard
from multigpu.backend.sharding import ShardedOptimizers as _Neutral

__all__ = ["ShardedOptimizers", "device_memory"]


def device_memory(devices) -> list[int | None]:
    """Each device's memory in bytes where known: a CPU device's given size, a GPU's total memory."""
    out: list[int | None] = []
    for d in devices:
        if d.memory is not None:
            out.append(int(d.memory))
        elif d.is_cuda and torch.cuda.is_available():
            out.append(int(torch.cuda.get_device_properties(d.index).total_memory))
        else:
            out.append(None)
    return out


class ShardedOptimizers(_Neutral):
    """The optimizers in parts of one parallel model on torch (arguments: the neutral class's)."""

    def device_memory(self, devices) -> list[int | None]:
        """A CPU device's given size, a GPU's total memory."""
        return device_memory(devices)

    def size(self, variable) -> int:
        return int(variable.value.numel())

    def empty(self, reference):
        return torch.empty(0, dtype=getattr(reference.value, "dtype", torch.float32))

    def resize(self, slot, variable, whole: bool) -> None:
        value = slot.value
        if whole:
            tensor = torch.zeros(tuple(slot.shape), dtype=value.dtype, device=value.device)
        else:
            tensor = torch.empty(0, dtype=value.dtype, device=value.device)
        _compat.set_variable_storage(slot, torch.nn.Parameter(tensor, requires_grad=False))

    def sum_owned(self, pairs: list[tuple[object, object]], shard: Shard, tag: int, what: str) -> None:
        if self.comm.alone:  # (the one rank left owns every part: nothing to share)
            return
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, bool]]] = {}
        for variable, model_variable in pairs:
            tensor = variable.value
            by_dtype.setdefault(tensor.dtype, []).append((tensor, id(model_variable) in shard.mine))
        for dtype, group in by_dtype.items():
            n = sum(int(t.numel()) for t, _ in group)
            buf = self.comm.buffer(n, dtype, disjoint=True)
            offset = 0
            with torch.no_grad():
                for tensor, mine in group:
                    size = int(tensor.numel())
                    if mine:
                        buf[offset : offset + size].copy_(tensor.reshape(-1))
                    offset += size
                layout = f"{what} ({n} values of {dtype})"
                summed = self.comm.reduce(buf, tag=tag, what=f"sharing {what}", describe=lambda layout=layout: layout)
                offset = 0
                for tensor, mine in group:
                    size = int(tensor.numel())
                    if not mine:
                        tensor.copy_(summed[offset : offset + size].view_as(tensor))
                    offset += size
