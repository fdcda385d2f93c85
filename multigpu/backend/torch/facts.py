"""The torch backend's facts: any local batch size, a scan to open the share search, torch's CUDA devices."""

from __future__ import annotations

from multigpu.backend.facts import Facts

__all__ = ["FACTS"]


def _gpu_count() -> int:
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver: no GPU, as torch itself would run
        return 0


def _gpu_info(index: int) -> dict:
    import torch

    prop = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return {"name": prop.name, "total_memory": total, "free_memory": free,
            "compute_capability": f"{prop.major}.{prop.minor}"}


def _versions() -> dict:
    import torch

    versions = {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    if torch.cuda.is_available():
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return versions


def _cpu_memory_environment(size: int) -> dict:
    """MKL's own allocator off (``MKL_DISABLE_FAST_MM``): it keeps the packing buffers of the largest matrix
    product run so far (about 17 MiB after a 400-row step of a 64 -> 8192 -> 10 model, measured by
    ``benchmarks/memory/bench_kept.py``), which the limit counts, so a device that ran a large batch once holds
    less after it. MKL reads it when it loads, hence the environment of the rank's process."""
    return {"MKL_DISABLE_FAST_MM": "1"}


FACTS = Facts("torch", grid=0, scan=True, gpu_count=_gpu_count, gpu_info=_gpu_info, versions=_versions,
              shard_optimizer=True, shard_gradients=True, shard_weights=True, elastic=True,
              cpu_memory_environment=_cpu_memory_environment)
