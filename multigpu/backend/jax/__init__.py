"""The JAX backend: ``jax.distributed`` (XLA's gloo collectives on CPU) and Keras's JAX trainer.

* ``group``: joining the run (before the program's first JAX computation) and leaving it;
* ``collectives``: ``Comm``, every collective multigpu does, as XLA all-reduces;
* ``step``: the training, test and predict functions Keras's loops call;
* ``facts``: ``FACTS``, what the layers above need to know of this backend.

Nothing here imports the framework: ``FACTS`` first, the rest at first use.
"""

from multigpu.backend import lazy
from multigpu.backend.jax.facts import FACTS

__all__ = ["FACTS", "Comm", "Steps", "bind", "join", "leave"]

__getattr__ = lazy(__name__, Comm="multigpu.backend.jax.collectives:Comm", Steps="multigpu.backend.jax.step:JaxSteps")
