"""What TensorFlow measures of a GPU's memory, for the neutral memory policy (:mod:`multigpu.balancing.caps`).

A GPU's step is measured by TensorFlow's allocator statistics
(``tf.config.experimental.get_memory_info``: the bytes in use, and the peak
since ``reset_memory_stats``) against the allocator's limit on that GPU (the
``memory_limit`` TensorFlow's device list gives: with memory growth on, which
each rank sets, what the GPU had free when TensorFlow took it).  TensorFlow's
allocator keeps what it grew for the next step, so nothing is given back
after a failed pass.  A CPU device given a memory size is measured by the
process's memory (:class:`~multigpu.balancing.caps.KeptProcessMemory`).

Built, not run on a GPU (no GPU on the machine the tests run on); the
arithmetic is tested with TensorFlow's functions stood in for
(``tests/test_driver.py``).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["GpuMemory", "allocator_limit"]


def allocator_limit(name: str) -> int | None:
    """The allocator's limit in bytes of the local device ``name`` (``"GPU:0"``), or None when not listed."""
    from tensorflow.python.client import device_lib

    for device in device_lib.list_local_devices():
        if device.name.endswith(f"/device:{name}"):
            return int(device.memory_limit) or None
    return None


class GpuMemory:
    """A :class:`~multigpu.balancing.caps.MemoryProbe` of one TensorFlow GPU.

    Args:
        name: the GPU as TensorFlow names it in this process (``"GPU:0"``: each rank sees its own alone).
        limit: the allocator's limit in bytes (None: looked up with :func:`allocator_limit` at first use).
        info: TensorFlow's ``get_memory_info`` (stood in for in tests).
        reset: TensorFlow's ``reset_memory_stats``.
    """

    def __init__(self, name: str = "GPU:0", limit: int | None = None, info: Callable | None = None,
                 reset: Callable | None = None) -> None:
        if info is None or reset is None:
            import tensorflow as tf

            info, reset = tf.config.experimental.get_memory_info, tf.config.experimental.reset_memory_stats
        self.name = name
        self.limit = limit
        self._info = info
        self._reset = reset

    def start(self) -> tuple[int, int] | None:
        if self.limit is None:
            self.limit = allocator_limit(self.name)
        if self.limit is None:
            return None
        self._reset(self.name)
        held = int(self._info(self.name)["current"])
        return held, self.limit - held

    def peak(self) -> int:
        return int(self._info(self.name)["peak"])

    def release(self) -> None:
        """TensorFlow's allocator keeps its pool for the next step: nothing to give back."""
