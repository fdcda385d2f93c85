"""``tf.data.Dataset`` input: the user's pipeline read once per machine, its batches as NumPy.

Keras's own dataset utilities (``image_dataset_from_directory``,
``text_dataset_from_directory``, ``audio_dataset_from_directory``,
``timeseries_dataset_from_array``) return a ``tf.data.Dataset`` by default,
and plain Keras takes one on every backend.  Here the dataset is a stream of
global batches (:class:`~multigpu.data.streams.StreamSource`): local rank 0
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

    Plain Keras on torch and JAX fails on such an element at its first batch
    with ``ValueError: Invalid dtype: object``; this raises the same error
    type, opening with the same words, and goes on to name the element and
    the way out.

    Raises:
        ValueError: a string, ragged or sparse component, naming it.
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
        raise ValueError(
            f"Invalid dtype: object. {what}: the dataset's element {path} holds {problem}, which Keras's "
            f"{keras.backend.backend()} backend cannot take as a tensor. Turn it into numbers inside the pipeline "
            "(a TextVectorization or StringLookup layer in `dataset.map`, `.to_tensor()` for ragged batches, "
            "`tf.sparse.to_dense`). "
            f"Received: element_spec={dataset.element_spec}"
        )


def _flat_with_paths(spec, path: str = "") -> list[tuple[str, object]]:
    if isinstance(spec, dict):
        return [p for k, v in spec.items() for p in _flat_with_paths(v, f"{path}[{k!r}]")]
    if isinstance(spec, (tuple, list)):
        return [p for i, v in enumerate(spec) for p in _flat_with_paths(v, f"{path}[{i}]")]
    return [(path or "(the whole element)", spec)]


def _as_tensorflow_would(dataset):
    """The dataset run as TensorFlow runs it in a process of its own on this machine.

    A rank on a CPU device is pinned to its core, and TensorFlow sizes a
    pipeline's thread pool by the cores a process may use: one.  Then a
    pipeline's ``num_parallel_calls`` and ``prefetch`` run one call at a time
    on the reading rank's core, and its work competes with that rank's
    training alone.  So, unless the pipeline sets its own
    ``threading.private_threadpool_size``, it gets a pool of the machine's
    CPU count, and the reader thread (whose affinity the pool's threads
    inherit) may run on every core.  Measured with ``bench_input.py`` on two
    cores, multigpu on two devices against a DDP loop of ranks reading their
    own shards: I/O-bound pipeline 0.71x pinned, 1.03x with the pool on every
    core; CPU-bound (TensorFlow's image ops) 0.75x and 0.97x (0.94x in a later three-round run)
    (``benchmarks/input/README.md``).
    """
    import os

    if dataset.options().threading.private_threadpool_size is None:
        import tensorflow as tf

        options = tf.data.Options()
        options.threading.private_threadpool_size = os.cpu_count() or 1
        dataset = dataset.with_options(options)
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))  # this thread only (Linux: pid 0 is the caller)
        except OSError:  # a container's CPU set narrower than the machine: keep the rank's
            pass
    return dataset


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
        """Iterated in the reader thread, where the pipeline's threads start: see :func:`_as_tensorflow_would`."""
        for batch in _as_tensorflow_would(self.dataset):
            yield keras.tree.map_structure(_to_numpy, batch)

    def __len__(self) -> int:
        """The dataset's number of batches (``TypeError`` when unknown or infinite, as ``len`` of an iterable)."""
        cardinality = int(self.dataset.cardinality())
        if cardinality < 0:
            raise TypeError("the dataset's cardinality is unknown or infinite")
        return cardinality
