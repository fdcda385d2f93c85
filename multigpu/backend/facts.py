"""What the layers above ``backend/`` need to know of a backend, declared by each backend in its own folder.

The facade, the planner, the command line and the device parser read a
:class:`Facts` (``multigpu.backend.facts()``) instead of testing the
backend's name or importing its framework, so that a backend is one folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["HALF_PRECISION", "Facts"]

# The 16-bit formats the gradient sum can send, by the name ``compression=`` takes, and the dtype's name in the
# framework (``torch.bfloat16``, ``jax.numpy.float16``, ...).
HALF_PRECISION = {"bf16": "bfloat16", "fp16": "float16"}


def _no_gpus() -> int:
    return 0


@dataclass(frozen=True)
class Facts:
    """A backend's policy and hardware facts.

    Attributes:
        name: the Keras backend's name (``keras.backend.backend()``).
        grid: local batch sizes are multiples of ``batch / grid`` and the share
            search moves by that much at least (a backend that compiles its step
            once per local batch size); 0 for any size.
        scan: whether the share search opens with a scan of shares (cheap where
            a new local batch size costs nothing).
        off_grid: whether the search, settled, may take one size off the grid where the speeds' balance lies
            between two of its sizes (a trace of a fraction of a second; not where a size compiles for seconds).
        compression: the names ``compression=`` takes beside ``None``.
        gpu_count: the GPUs this process can use.
        gpu_info: one GPU's facts by index: at least ``name``, and where the
            framework can tell, ``total_memory`` and ``free_memory`` in bytes.
        versions: the framework's versions for reports (``{"torch": ..., "cuda": ...}``).
        shard_optimizer: whether ``parallelize(..., shard_optimizer=True)`` is built for the backend.
        shard_by_default: whether the optimizer state goes in parts by default where the sums run through
            shared memory (measured faster and smaller on torch and TensorFlow; on JAX the parts live in the
            compiled step's state, a device set aside cannot leave them, and they were not measured faster).
        sums_among_gpus: whether the step's sums can run over part of the ranks (devices set aside, more than one
            left) on GPUs too; JAX's XLA sums are over every rank, its shared memory (CPU devices of one machine)
            can.
        shard_gradients: whether ``parallelize(..., shard="gradients")`` is built for the backend.
        shard_weights: whether ``parallelize(..., shard="weights")`` is built for the backend.
        elastic: whether a run may go on without a lost device (``min_devices``): its engine can leave a
            broken group and form a new one of the survivors.
        sums_on_host: whether the step's sums run in host memory whatever the devices (a gloo group even
            on GPUs alone), rather than on the devices (NCCL where every device is a GPU).
        join_first: whether a rank joins the run before the program runs (the framework takes its devices,
            or allows its distributed start, only before its first computation).
        cpu_memory_environment: the environment variables a rank on a CPU device given ``size`` bytes needs,
            so that the framework's allocator keeps within it (TensorFlow: its pool of large tensors, which it
            never gives back, held to half the size).
        takes_torch_tensors: whether ``keras.ops.convert_to_tensor`` takes a torch tensor (a DataLoader's).
        warm_up: what a rank on a CPU device given a memory size runs before its limit begins: what the
            framework allocates once per process and never gives back (JAX: its CPU client's thread pools, which
            abort the process when they cannot allocate), so that the device's memory is the training's.
    """

    name: str
    grid: int = 0
    scan: bool = True
    off_grid: bool = False
    compression: tuple[str, ...] = tuple(HALF_PRECISION)
    gpu_count: Callable[[], int] = field(default=_no_gpus)
    gpu_info: Callable[[int], dict] = field(default=lambda index: {"name": "GPU"})
    versions: Callable[[], dict] = field(default=dict)
    shard_optimizer: bool = False
    shard_by_default: bool = True
    sums_among_gpus: bool = True
    shard_gradients: bool = False
    shard_weights: bool = False
    elastic: bool = False
    sums_on_host: bool = False
    join_first: bool = False
    takes_torch_tensors: bool = True
    cpu_memory_environment: Callable[[int], dict] = field(default=lambda size: {})
    warm_up: Callable[[], None] = field(default=lambda: None)
