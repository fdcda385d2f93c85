"""The TensorFlow backend's facts: local batch sizes on a grid of 1/32 of the batch, no opening scan, the driver's GPUs.

multigpu traces the TensorFlow step once per local batch size (Keras weighs
each output's loss by the batch size the trace knows, and XLA compiles per
shape), so local batch sizes are multiples of 1/32 of the batch, the share
search moves by that much at least, and it does not open with a scan.  1/32
rather than JAX's 1/16: a trace costs a fraction of a second where a JAX
compilation costs more, and on the TensorFlow demo (batch 512, the devices
computing 3,800 and 2,059 samples/s: even at 332 rows) 1/16's steps of 32 rows
left the slow device waiting 14% to 17% of a step at 352; 336 is on 1/32's.  Settled, the search may take
one size off the grid, the compute speeds' balance between two of its sizes (``off_grid``: one more trace).
TensorFlow may not be configured (visible GPUs, threads) after its first
computation, so the GPUs are counted and named by the NVIDIA driver, without
importing TensorFlow.
"""

from __future__ import annotations

from multigpu.backend.facts import Facts
from multigpu.devices import driver_gpu_count, driver_gpu_name

__all__ = ["FACTS"]


def _versions() -> dict:
    import importlib.metadata as md

    versions = {}
    for name in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "torch"):  # torch: the engine that sums
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return versions


POOL = 0.5  # of a CPU device's given memory, what TensorFlow's pool of large tensors may hold


def _pool(size: int) -> dict[str, str]:
    """TensorFlow's CPU allocator pools large tensors and never gives the pool back: held to a part of the
    device's memory, it fails cleanly (a step taken again) and leaves room for the step's sums."""
    return {"TF_MKL_ALLOC_MAX_BYTES": str(int(size * POOL))}


FACTS = Facts("tensorflow", grid=32, scan=False, off_grid=True, elastic=True, shard_optimizer=True, sums_on_host=True,
              join_first=True, gpu_count=driver_gpu_count,
              gpu_info=lambda index: {"name": driver_gpu_name(index)}, versions=_versions,
              cpu_memory_environment=_pool)
