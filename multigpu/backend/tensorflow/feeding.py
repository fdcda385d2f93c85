"""This rank's share of each global batch, as Keras's TensorFlow loop reads it.

Keras's TensorFlow ``fit`` reads its data adapter's ``get_tf_dataset()`` and
hands the model's train function an iterator over it.  multigpu's adapter
(:class:`multigpu.keras.data.ShardedData`) yields NumPy batches whose number
of rows follows the shares, and multigpu's train function is Python (it calls
the step's ``tf.function`` itself: :mod:`.step`), so nothing needs a
``tf.data`` pipeline here: :func:`dataset` gives Keras's loop a
``tf.distribute.DistributedDataset`` (which Keras takes as it is) whose
iterator starts a pass over the adapter and yields each batch as tensors.

Measured: ``tf.data.Dataset.from_generator`` costs about 4.5 ms a batch here
(the MLP at batch 64 on two CPU devices: 7.8 ms a step against 3.2 ms for its
computation, sum and update), which is more than a small model's step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import keras
import tensorflow as tf

__all__ = ["dataset"]


def _tensor(leaf):
    return None if leaf is None else tf.convert_to_tensor(leaf)


class _Passes(tf.distribute.DistributedDataset):
    """Each iteration a new pass over the batches, every part a tensor (None where a part is missing)."""

    def __init__(self, passes: Callable[[], Iterator]) -> None:
        self._passes = passes

    def __iter__(self) -> Iterator:
        for batch in self._passes():
            yield keras.tree.map_structure(_tensor, keras.tree.lists_to_tuples(batch))


def dataset(passes: Callable[[], Iterator]) -> tf.distribute.DistributedDataset:
    """What ``get_tf_dataset()`` returns: reads ``passes()`` anew for each iteration.

    Args:
        passes: starts a pass over the batches (tuples of arrays, None where a part is missing).
    """
    return _Passes(passes)
