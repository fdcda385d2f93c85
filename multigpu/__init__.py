"""multigpu: data-parallel Keras 3 training across devices of any speed.

Importing this package sets nothing and imports neither Keras nor torch.

Example:
    ```python
    import multigpu
    model = multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], ratios=[3, 1])
    ```
"""

from multigpu.api import list_devices, multi_gpu_model, parallelize, rank, state, world_size

__all__ = ["list_devices", "multi_gpu_model", "parallelize", "rank", "state", "world_size"]
__version__ = "0.2.0"
