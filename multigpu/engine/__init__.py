"""The engine the torch and TensorFlow backends sum on: torch.distributed, with shared memory within a machine.

* ``group``: the process group (rendezvous, join, leave; gloo, or NCCL where every device is a GPU);
* ``comm``: ``Comm``, every collective a run makes, and its regrouping after a lost device;
* ``shm``: the step's sum through shared memory, for ranks of one machine whose vectors are in host memory.

JAX sums inside XLA over ``jax.distributed`` (:mod:`multigpu.backend.jax`), not here.
"""
