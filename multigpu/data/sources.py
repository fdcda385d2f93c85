"""The source of every input form ``fit``, ``evaluate`` and ``predict`` take; validates the user's arguments."""

from __future__ import annotations

from multigpu.data.arrays import ArraySource
from multigpu.data.forms import input_kind, is_array_data
from multigpu.data.host import Host
from multigpu.data.loader import LoaderSource, can_cut_by_index
from multigpu.data.readers import PyDatasetSource
from multigpu.data.streams import StreamSource
from multigpu.data.tfdata import NumpyBatches, check_element_spec

__all__ = ["source_for"]


def source_for(x, y, sample_weight, batch_size, shuffle, seed: int, what: str, host: Host):
    """The global batches of ``x`` (with ``y``/``sample_weight`` for arrays) for this rank.

    Args:
        x, y, sample_weight, batch_size, shuffle: as the user passed them.
        seed: the call's shared seed (the shuffled orders and the names of its files).
        what: ``"fit"``, ``"evaluate"``, ... for messages.
        host: this rank's machine.

    Raises:
        TypeError, ValueError: naming what was received and what is allowed.
    """
    from multigpu._warn import warn_user

    kind = input_kind(x)
    if kind == "arrays":
        if (y is not None or sample_weight is not None) and not is_array_data(
            *(s for s in (y, sample_weight) if s is not None)
        ):
            raise TypeError(
                f"{what}: `y` and `sample_weight` must be NumPy arrays or torch tensors when `x` is. "
                f"Received: y of type {type(y).__name__}, sample_weight of type {type(sample_weight).__name__}"
            )
        return ArraySource(x, y, sample_weight, batch_size, shuffle, seed)
    if kind == "other":
        raise TypeError(
            f"{what}: multigpu takes arrays (NumPy, torch, JAX, TensorFlow, pandas; alone, or in lists and dicts), "
            "a keras.utils.PyDataset, a Python generator, a torch DataLoader, a batched grain dataset or a "
            "tf.data.Dataset. "
            f"Received: x of type {type(x).__name__}"
        )
    if y is not None or sample_weight is not None:
        raise ValueError(f"{what}: with a {kind}, `y` and `sample_weight` come from the data; pass None. "
                         f"Received: y of type {type(y).__name__}")
    if batch_size is not None and host.rank == 0:
        warn_user(f"{what}: `batch_size` is ignored for a {kind}; its batches are the global batches.")
    if kind == "pydataset":
        return PyDatasetSource(x, shuffle, seed, host)
    if kind == "dataloader" and can_cut_by_index(x):
        return LoaderSource(x, host.comm, host.rank)
    if kind == "tf.data":
        check_element_spec(x, what)
        x = NumpyBatches(x)
        return StreamSource(x, host, slow_start=2)
    if host.hosts > 1 and host.rank == 0:
        warn_user(
            f"{what}: each machine reads its own copy of this {kind} and its ranks take their shares of each "
            "batch. The result is exact only if every copy yields the same batches in the same order (seed any "
            "shuffling, e.g. keras.utils.set_random_seed before building it)."
        )
    return StreamSource(x, host)
