"""The run's processes on TensorFlow: TensorFlow bound to one device, torch.distributed's group for the sums.

TensorFlow chooses its visible devices and thread pools at its first
computation and refuses to change them afterwards, while a user's script
builds its model before it calls ``parallelize``.  So the ranks multigpu
starts bind and join as soon as they start, before the script runs
(:mod:`multigpu.runtime.rank_entry` calls :func:`multigpu.runtime.start`
first when ``KERAS_BACKEND=tensorflow``, as on JAX).  A rank sees only its own
GPU, with memory growth on, or no GPU at all for a CPU device, and TensorFlow
uses its cores only.

The sums go through torch.distributed's gloo group, always on the host
(:mod:`multigpu.backend.tensorflow` says why): a GPU run does not need
NCCL's torch build.
"""

from __future__ import annotations

from multigpu.engine import group as _engine

__all__ = ["bind", "join", "leave"]


def bind(device) -> None:
    """Makes TensorFlow use this process's device alone: its GPU (memory growth on) or its cores.

    It takes effect only before TensorFlow's first computation: the ranks
    multigpu starts bind as soon as they start.  A single-device run whose
    script computed already keeps TensorFlow's own choice.
    """
    import tensorflow as tf

    try:
        gpus = tf.config.list_physical_devices("GPU")
        if device.is_cuda:
            if device.index >= len(gpus):
                raise RuntimeError(
                    f"device {device.spec!r} is a GPU, but TensorFlow {tf.__version__} sees {len(gpus)} GPU(s): "
                    "install TensorFlow's CUDA build (pip install 'tensorflow[and-cuda]'), or use CPU devices.")
            tf.config.set_visible_devices([gpus[device.index]], "GPU")
            tf.config.experimental.set_memory_growth(gpus[device.index], True)
        else:
            tf.config.set_visible_devices([], "GPU")
            if device.cores:
                tf.config.threading.set_intra_op_parallelism_threads(len(device.cores))
                tf.config.threading.set_inter_op_parallelism_threads(len(device.cores))
    except RuntimeError as exc:
        if "cannot be modified after" not in str(exc) and "initialized" not in str(exc):
            raise
    import torch

    torch.set_num_threads(1)  # torch only adds vectors here: one thread, off TensorFlow's cores


def join(runtime) -> None:
    """Joins the run's gloo group (sums on the host, whatever the devices)."""
    _engine.join(runtime, process_group="gloo")


def leave(failed: bool) -> None:
    """Leaves the run at exit: with the others after a success, at once after a failure."""
    _engine.leave(failed)
