"""``tf.data.Dataset`` input: the user's pipeline read once per machine, its batches as NumPy.

Keras's own dataset utilities (``image_dataset_from_directory``,
``text_dataset_from_directory``, ``audio_dataset_from_directory``,
``timeseries_dataset_from_array``) return a ``tf.data.Dataset`` by default,
and plain Keras takes one on every backend.  Here the dataset is a stream of
global batches (:class:`~multigpu.data.readers.StreamSource`): local rank 0
of each machine iterates it in a background thread, ahead of the step, with
the pipeline's own parallelism (``map(num_parallel_calls=...)``,
``interleave``, ``prefetch``, ``cache``), and every rank of the machine takes
only its rows of each batch, cut by the shares in force when it takes it.

A pass over the data is one iterator of the dataset, created when Keras
starts a pass, as Keras's own adapter does: a dataset's ``shuffle(seed=...)``
with ``reshuffle_each_iteration`` gives the same orders as on one device, and
with ``steps_per_epoch`` Keras keeps one iterator across epochs (``repeat()``).

TensorFlow is imported only here, and only when the data is a dataset
(:func:`multigpu.data.forms.input_kind` recognises one by its class's module).
"""

from __future__ import annotations

from collections.abc import Iterator

import keras

__all__ = ["NumpyBatches", "check_element_spec"]


def check_element_spec(dataset, what: str) -> None:
    """Refuses, before any batch is read and on every rank, elements that torch and JAX cannot take.

    Raises:
        TypeError: a string, ragged or sparse component, naming it.
    """
    import tensorflow as tf

    for path, spec in _flat_with_paths(dataset.element_spec):
        if isinstance(spec, tf.RaggedTensorSpec):
            problem = "a ragged tensor (tf.RaggedTensor)"
        elif isinstance(spec, tf.SparseTensorSpec):
            problem = "a sparse tensor (tf.SparseTensor)"
        elif getattr(spec, "dtype", None) == tf.string:
            problem = "strings (tf.string)"
        else:
            continue
        raise TypeError(
            f"{what}: the dataset's element {path} holds {problem}, which Keras's {keras.backend.backend()} "
            "backend cannot take as a tensor. Turn it into numbers inside the pipeline (a TextVectorization or "
            "StringLookup layer in `dataset.map`, `.to_tensor()` for ragged batches, `tf.sparse.to_dense`). "
            f"Received: element_spec={dataset.element_spec}"
        )


def _flat_with_paths(spec, path: str = "") -> list[tuple[str, object]]:
    if isinstance(spec, dict):
        return [p for k, v in spec.items() for p in _flat_with_paths(v, f"{path}[{k!r}]")]
    if isinstance(spec, (tuple, list)):
        return [p for i, v in enumerate(spec) for p in _flat_with_paths(v, f"{path}[{i}]")]
    return [(path or "(the whole element)", spec)]


def _to_numpy(value):
    return value if value is None else value.numpy()


class NumpyBatches:
    """A dataset's batches as NumPy arrays, one dataset iterator per pass (what Keras's adapter does).

    Args:
        dataset: the ``tf.data.Dataset`` (batched: each element is a global batch).
    """

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator:
        for batch in self.dataset:
            yield keras.tree.map_structure(_to_numpy, batch)

    def __len__(self) -> int:
        """The dataset's number of batches (``TypeError`` when unknown or infinite, as ``len`` of an iterable)."""
        cardinality = int(self.dataset.cardinality())
        if cardinality < 0:
            raise TypeError("the dataset's cardinality is unknown or infinite")
        return cardinality
