"""What JAX measures of a GPU's memory, for the neutral memory policy (:mod:`multigpu.balancing.caps`).

A GPU's step is measured by XLA's allocator statistics (``Device.memory_stats()``):
the bytes in use before the step, the allocator's limit, and its peak.  XLA
cannot reset the peak, so a step's peak is the largest since the process
began: a smaller step after a larger one reads the larger one's peak, which
only makes its cap lower than it could be.  A CPU device given a memory size
is measured as on every backend, by the process's memory
(:class:`~multigpu.balancing.caps.ProcessMemory`); a device whose statistics
say nothing (a CPU device) is not measured here.
"""

from __future__ import annotations

__all__ = ["GpuMemory"]


class GpuMemory:
    """A :class:`~multigpu.balancing.caps.MemoryProbe` of one JAX device.

    Args:
        device: the rank's ``jax.Device``.
    """

    def __init__(self, device) -> None:
        self.device = device

    def _stats(self) -> dict:
        return self.device.memory_stats() or {}

    def start(self) -> tuple[int, int] | None:
        stats = self._stats()
        if "bytes_limit" not in stats:
            return None
        held = int(stats.get("bytes_in_use", 0))
        return held, int(stats["bytes_limit"]) - held

    def peak(self) -> int:
        stats = self._stats()
        return int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))

    def release(self) -> None:
        """XLA's allocator keeps its pool for the next step: nothing to give back."""
