"""The JAX backend: ``jax.distributed`` (XLA's gloo collectives on CPU) and Keras's JAX trainer.

* ``group``: joining the run (before the program's first JAX computation) and leaving it;
* ``collectives``: ``Comm``, every collective multigpu does, as XLA all-reduces;
* ``step``: the training, test and predict functions Keras's loops call;
* ``facts``: ``FACTS``, what the layers above need to know of this backend.

Only ``group`` is imported eagerly, and it imports JAX only when joining.
"""

from multigpu.backend import lazy
from multigpu.backend.jax.facts import FACTS
from multigpu.backend.jax.group import bind, join, leave

__all__ = ["FACTS", "Comm", "Steps", "bind", "join", "leave"]


__getattr__ = lazy(Comm="multigpu.backend.jax.collectives:Comm", Steps="multigpu.backend.jax.step:JaxSteps")
