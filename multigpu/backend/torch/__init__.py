"""The torch backend: torch.distributed (gloo on CPU, NCCL on CUDA) and Keras's torch trainer.

* ``group``: the process group (rendezvous, join, leave, device binding);
* ``collectives``: ``Comm``, every collective multigpu does (shared memory for CPU ranks of one machine);
* ``reducer``: the share-weighted gradient sum inside ``optimizer.apply``;
* ``metrics``: global logs from summed metric states;
* ``step``: the training, test and predict steps;
* ``batchnorm``: BatchNorm statistics across devices;
* ``facts``: ``FACTS``, what the layers above need to know of this backend.

Only ``group`` is imported eagerly.
"""

from multigpu.backend.torch.facts import FACTS
from multigpu.backend.torch.group import bind, join, leave

__all__ = ["FACTS", "Comm", "Steps", "bind", "join", "leave"]


def __getattr__(name: str):
    if name == "Comm":
        from multigpu.backend.torch.collectives import Comm

        return Comm
    if name == "Steps":
        from multigpu.backend.torch.step import TorchSteps

        return TorchSteps
    raise AttributeError(name)
