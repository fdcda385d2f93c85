"""This rank's share of each global batch as the ``tf.data.Dataset`` Keras's TensorFlow loop reads.

Keras's TensorFlow ``fit`` reads its data adapter's ``get_tf_dataset()``.
multigpu's adapter (:class:`multigpu.keras.data.ShardedData`) yields NumPy
batches whose number of rows follows the shares, so the dataset is built
with ``from_generator`` and a signature whose first dimension is unknown,
read off the pass's first batch.  Each iteration of the dataset starts a new
pass over the adapter (as Keras's other backends start one per
iteration); the pass that was opened to read the signature is the first one
served.  Missing parts of a batch (no target, no weight) travel as empty
``tf.experimental.Optional`` values and lists as tuples, as in Keras's own
generator adapter,
and the steps turn them back into None.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import keras
import tensorflow as tf

__all__ = ["dataset"]


def _spec(leaf):
    if leaf is None:
        return tf.OptionalSpec(None)
    if isinstance(leaf, (str, bytes)):
        return tf.TensorSpec((), tf.string)
    dtype = tf.as_dtype(keras.backend.standardize_dtype(leaf.dtype))
    shape = tuple(getattr(leaf, "shape", ()))
    return tf.TensorSpec((None, *shape[1:]) if shape else (), dtype)


def dataset(passes: Callable[[], Iterator]) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` that reads ``passes()`` anew for each iteration.

    Args:
        passes: starts a pass over the batches (tuples of arrays, None where a part is missing).

    Raises:
        ValueError: when the pass has no batch.
    """
    first_pass = passes()
    try:
        first = next(first_pass)
    except StopIteration:
        raise ValueError("multigpu: the data gave no batch on this rank; every pass must give at least one "
                         "(global) batch. Received: an empty pass") from None
    signature = keras.tree.map_structure(_spec, keras.tree.lists_to_tuples(first), none_is_leaf=True)
    pending = [itertools.chain([first], first_pass)]

    def to_tf(batch):
        return keras.tree.map_structure(lambda a: tf.experimental.Optional.empty(None) if a is None else a,
                                        keras.tree.lists_to_tuples(batch), none_is_leaf=True)

    def generator():
        batches = pending.pop() if pending else passes()
        for batch in batches:
            yield to_tf(batch)

    return tf.data.Dataset.from_generator(generator, output_signature=signature)
