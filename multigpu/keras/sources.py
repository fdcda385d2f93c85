"""The global batches of every input form Keras takes, for :class:`multigpu.keras.data.ShardedData`.

Each source yields global batch after global batch, asking ``plan_of(rows)``
for the batch's plan and keeping this rank's rows of it:

* :class:`_Arrays`: arrays and tensors (alone, in lists, tuples, dicts);
  global step ``i`` is rows ``[i*B, (i+1)*B)`` of the data, or of a
  permutation drawn from the run's shared seed when shuffling; floats become
  ``floatx`` as in Keras's array adapter;
* :class:`_PyDataset`: every rank reads each global batch ``ds[i]`` (in a
  shared shuffled order) and keeps its share;
* :class:`_Iterable`: generators and ``torch.utils.data.DataLoader``; every
  rank iterates its own copy and keeps its share of each batch.

:func:`source_for` picks one and validates the user's arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator

import keras
import numpy as np

from multigpu.keras.data import _leaves, input_kind, is_array_data, num_rows
from multigpu.planning.plan import StepPlan, num_steps

__all__ = ["source_for"]


def _to_floatx(a):
    """Floats that are not ``floatx`` become ``floatx``, as Keras's array adapter does."""
    floatx = keras.backend.floatx()
    if isinstance(a, np.ndarray):
        if a.dtype.kind == "f" and a.dtype != np.dtype(floatx):
            return a.astype(floatx)
        return a
    dtype = keras.backend.standardize_dtype(a.dtype)
    if keras.backend.is_float_dtype(dtype) and dtype != floatx:
        return keras.ops.cast(a, floatx)
    return a


def _take(array, index):
    if isinstance(index, slice) or isinstance(array, np.ndarray):
        return array[index]
    import torch

    return array[torch.as_tensor(index, device=array.device)]


def _standardize(batch):
    """A batch as Keras's dataset adapters pass it on: a dict as it is, a list as a tuple, an array as ``(x,)``."""
    if isinstance(batch, list):
        return tuple(batch)
    return batch if isinstance(batch, (tuple, dict)) else (batch,)


def _cut(batch, plan: StepPlan):
    begin, end = plan.rows(plan.rank)
    return keras.tree.map_structure(lambda a: None if a is None else a[begin:end], batch)


def _batch_rows(batch) -> int:
    leaves = _leaves(batch)
    if not leaves:
        raise ValueError(f"A batch must contain at least one array. Received: {type(batch).__name__} {batch!r:.100}")
    return int(leaves[0].shape[0])


class _Arrays:
    """Global batches of arrays: rows ``[i*B, (i+1)*B)`` of the (shuffled) order."""

    def __init__(self, x, y, sample_weight, batch_size: int, shuffle, seed: int) -> None:
        parts = [x, y, sample_weight]
        self.parts = tuple(None if p is None else keras.tree.map_structure(_to_floatx, p) for p in parts)
        self.rows = num_rows(x, y, sample_weight)
        self.batch_size = int(batch_size)
        self.shuffle, self.seed = shuffle, int(seed)
        self.order: np.ndarray | None = None

    @property
    def num_batches(self) -> int:
        return num_steps(self.rows, self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        if not self.shuffle:
            self.order = None
            return
        rng = np.random.default_rng([self.seed, epoch])
        if self.shuffle == "batch":
            order = np.arange(self.rows)
            for start in range(0, self.rows, self.batch_size):
                rng.shuffle(order[start : start + self.batch_size])
            self.order = order
        else:
            self.order = rng.permutation(self.rows)

    def batches(self, plan_of: Callable[[int], StepPlan]) -> Iterator[tuple]:
        for step in range(self.num_batches):
            start = step * self.batch_size
            plan = plan_of(min(self.batch_size, self.rows - start))
            begin, end = plan.rows(plan.rank, start)
            index = slice(begin, end) if self.order is None else self.order[begin:end]
            parts = [None if p is None else keras.tree.map_structure(lambda a, i=index: _take(a, i), p)
                     for p in self.parts]
            yield keras.utils.pack_x_y_sample_weight(*parts)  # as Keras's array adapter: x alone is not a tuple


class _PyDataset:
    """Every rank reads each global batch of a ``PyDataset`` (shared shuffled order) and keeps its share."""

    def __init__(self, dataset, shuffle: bool, seed: int) -> None:
        self.dataset, self.shuffle, self.seed = dataset, bool(shuffle), int(seed)
        self.order: np.ndarray | None = None

    @property
    def num_batches(self):
        return self.dataset.num_batches

    def set_epoch(self, epoch: int) -> None:
        n = self.dataset.num_batches
        self.order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle and n else None

    def batches(self, plan_of: Callable[[int], StepPlan]) -> Iterator[tuple]:
        n = self.dataset.num_batches
        i = 0
        while n is None or i < n:
            index = int(self.order[i]) if self.order is not None else i
            try:
                batch = _standardize(self.dataset[index])
            except IndexError:
                if n is None:
                    return
                raise
            yield _cut(batch, plan_of(_batch_rows(batch)))
            i += 1

    def on_epoch_begin(self) -> None:
        if hasattr(self.dataset, "on_epoch_begin"):
            self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()


class _Iterable:
    """Every rank iterates its own copy of a generator or DataLoader and keeps its share of each batch.

    A generator runs once: batches that were taken but not trained on (Keras
    takes one to build the model) are given again at the next pass.
    """

    def __init__(self, source) -> None:
        self.source = source
        self.one_shot = inspect.isgenerator(source) or iter(source) is source
        self._iterator = iter(source) if self.one_shot else None
        self._unused: list = []

    @property
    def num_batches(self):
        try:
            return len(self.source)
        except TypeError:
            return None

    def set_epoch(self, epoch: int) -> None:
        pass

    def _raw(self) -> Iterator:
        if not self.one_shot:
            yield from self.source
            return
        while self._unused:
            yield self._unused[0]
            self._unused.pop(0)  # reached only when the consumer asked for the next one
        for item in self._iterator:
            self._unused.append(item)
            yield item
            self._unused.pop()

    def batches(self, plan_of: Callable[[int], StepPlan]) -> Iterator[tuple]:
        for item in self._raw():
            batch = _standardize(item)
            yield _cut(batch, plan_of(_batch_rows(batch)))


def source_for(x, y, sample_weight, batch_size, shuffle, seed: int, what: str, rank: int):
    """The global batches of ``x`` (with ``y``/``sample_weight`` for arrays); validates on the way.

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
        return _Arrays(x, y, sample_weight, batch_size, shuffle, seed)
    if kind == "other":
        raise TypeError(
            f"{what}: multigpu takes NumPy arrays or torch tensors (alone, or in lists and dicts), "
            f"a keras.utils.PyDataset, a Python generator or a torch DataLoader. Received: x of type {type(x).__name__}"
        )
    if y is not None or sample_weight is not None:
        raise ValueError(f"{what}: with a {kind}, `y` and `sample_weight` come from the data; pass None. "
                         f"Received: y of type {type(y).__name__}")
    if batch_size is not None and rank == 0:
        warn_user(f"{what}: `batch_size` is ignored for a {kind}; its batches are the global batches.")
    if kind == "pydataset":
        return _PyDataset(x, shuffle, seed)
    if rank == 0:
        warn_user(
            f"{what}: every rank iterates its own copy of this {kind} and keeps its share of each batch. The "
            "result is exact only if every copy yields the same batches in the same order (seed any shuffling, "
            "e.g. keras.utils.set_random_seed before building it)."
        )
    return _Iterable(x)
