"""The JAX backend's facts: local batch sizes on a grid of 1/16 of the batch, no opening scan, the driver's GPUs.

JAX compiles the step once per local batch size (about 6 s for the benchmark
convnet on one core), so local batch sizes are multiples of 1/16 of the batch,
each compiled once, the share search moves by that much at least, and it does
not open with a scan.  JAX may not compute before a rank joins the run, so the
GPUs are counted and named by the NVIDIA driver, without importing JAX.
"""

from __future__ import annotations

from multigpu.backend.facts import Facts
from multigpu.devices import driver_gpu_count, driver_gpu_name

__all__ = ["FACTS"]


def _versions() -> dict:
    import importlib.metadata as md

    return {name: md.version(name) for name in ("jax", "jaxlib")}


def _warm_up() -> None:
    """JAX's CPU client, its thread pools and a first dispatch, made before a CPU device's memory limit (under
    it they abort the process with ``std::bad_alloc`` instead of raising)."""
    import jax.numpy as jnp

    (jnp.ones(8) @ jnp.ones(8)).block_until_ready()


FACTS = Facts("jax", grid=16, scan=False, join_first=True, shard_optimizer=True, shard_by_default=False,
              sums_among_gpus=False, takes_torch_tensors=False,
              gpu_count=driver_gpu_count,
              gpu_info=lambda index: {"name": driver_gpu_name(index)}, versions=_versions, warm_up=_warm_up)
