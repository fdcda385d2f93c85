"""What torch measures of a GPU's memory, for the neutral memory policy (:mod:`multigpu.balancing.caps`).

A CUDA device's step is measured by torch's allocator statistics: the peak
allocation since the step began, and the memory left (the GPU's free memory
and torch's unused cache).  A CPU device given a memory size is measured as
on every backend, by the process's memory
(:class:`~multigpu.balancing.caps.ProcessMemory`).
"""

from __future__ import annotations

import torch

__all__ = ["CudaMemory"]


class CudaMemory:
    """A :class:`~multigpu.balancing.caps.MemoryProbe` of one CUDA device.

    Args:
        device: the rank's ``torch.device``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> tuple[int, int]:
        torch.cuda.reset_peak_memory_stats(self.device)
        held = torch.cuda.memory_allocated(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        return held, free + torch.cuda.memory_reserved(self.device) - held

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def release(self) -> None:
        torch.cuda.empty_cache()
