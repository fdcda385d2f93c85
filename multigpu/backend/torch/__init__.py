"""The torch backend: torch.distributed (gloo on CPU, NCCL on CUDA) and Keras's torch trainer.

* ``group``: device binding; the process group and ``Comm`` are the engine's (:mod:`multigpu.engine`);
* ``reducer``: the share-weighted gradient sum inside ``optimizer.apply``;
* ``metrics``: global logs from summed metric states;
* ``step``: the built-in training step (``custom``: a ``train_step`` of the model's own; ``evaluation``: the test
  and predict steps and the global logs);
* ``batchnorm``: BatchNorm statistics across devices;
* ``facts``: ``FACTS``, what the layers above need to know of this backend.

Nothing here imports the framework: ``FACTS`` first, the rest at first use.
"""

from multigpu.backend import lazy
from multigpu.backend.torch.facts import FACTS

__all__ = ["FACTS", "Comm", "Steps", "bind", "join", "leave"]

__getattr__ = lazy(__name__, Comm="multigpu.engine.comm:Comm", Steps="multigpu.backend.torch.step:TorchSteps")
