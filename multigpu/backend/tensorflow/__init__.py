"""The TensorFlow backend: Keras's TensorFlow trainer, gradients summed by torch.distributed.

* ``group``: binding TensorFlow to this process's device, joining the run and leaving it;
* ``collectives``: ``Comm``, every collective multigpu does (the engine's, :mod:`multigpu.engine`, on NumPy arrays);
* ``feeding``: this rank's share of each global batch as the iterable Keras's loop reads;
* ``step``: the training function Keras's loop calls, with ``functions`` (Keras's ``train_step`` split at the
  sum), ``evaluation`` (test and predict) and ``states``
  (what a step keeps to be taken again after a lost device; the global metric results);
* ``custom``: a ``train_step`` of the model's own (``tf.GradientTape`` and ``optimizer.apply``);
* ``facts``: ``FACTS``, what the layers above need to know of this backend.

Why torch.distributed sums TensorFlow's gradients: TensorFlow's own
cross-process collectives (``MultiWorkerMirroredStrategy``'s ring over gRPC)
took 8.1 ms for an all-reduce of 1M floats between two processes on two
cores of one x86-64 machine, gloo 4.0 ms, and the shared-memory transport
0.57 ms (``benchmarks/bench_tf_engines.py``, ``benchmarks/tensorflow/README.md``); one
of the ring's rounds also failed to start.  So the TensorFlow backend sums on
the engine the torch backend sums on (:mod:`multigpu.engine`): shared memory
between ranks of one machine, gloo elsewhere (TensorFlow's GPU tensors are summed on the host).
TensorFlow users install torch's CPU wheel beside TensorFlow (``make``
does).

Nothing here imports the framework: ``FACTS`` first, the rest at first use.
"""

from multigpu.backend import lazy
from multigpu.backend.tensorflow.facts import FACTS

__all__ = ["FACTS", "Comm", "Steps", "bind", "join", "leave"]

__getattr__ = lazy(__name__, Comm="multigpu.backend.tensorflow.collectives:Comm",
                   Steps="multigpu.backend.tensorflow.step:TensorFlowSteps")
