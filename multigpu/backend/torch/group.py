"""The run's processes on torch: each bound to its device; the group is the engine's (:mod:`multigpu.engine.group`)."""

from __future__ import annotations

import torch

from multigpu.engine.group import join, leave

__all__ = ["bind", "join", "leave"]


def bind(device) -> None:
    """Makes torch use this process's device: its cores (threads) or its GPU."""
    if device.is_cuda:
        torch.cuda.set_device(device.index)
    elif device.cores:
        torch.set_num_threads(len(device.cores))
