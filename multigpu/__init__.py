"""multigpu: data-parallel Keras 3 training across devices of any speed.

Importing this package sets nothing and imports neither Keras nor torch.

Example:
    ```python
    import multigpu
    model = multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], ratios=[3, 1])
    ```

    In a notebook, put the training in a function and run it with
    ``multigpu.launch(train, devices=[...])``.
"""

from multigpu.api import list_devices, multi_gpu_model, parallelize, rank, state, unparallelize, world_size
from multigpu.runtime.launcher import RankError, launch
from multigpu.runtime.load_once import load_once

__all__ = ["RankError", "launch", "list_devices", "load_once", "multi_gpu_model", "parallelize", "rank", "state",
           "unparallelize", "world_size"]
__version__ = "0.3.0"
