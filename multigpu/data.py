"""Data sharding: each rank's slice of every global batch.

For NumPy arrays and torch tensors (alone, or in lists, tuples and dicts, as
Keras accepts them) global step ``i`` covers rows ``[i*B, (i+1)*B)`` of the
data (of the shuffled order when shuffling), and rank ``r`` takes its share of
that step as a contiguous run of rows.  Every rank computes the same
permutation from a seed that rank 0 chose, so no data crosses processes.
Nothing is copied but the rows of the current batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from multigpu.planning import num_steps

__all__ = ["ShardedArrays", "is_array_data", "num_rows", "rank_rows"]


def _leaves(structure) -> list:
    import keras

    return [leaf for leaf in keras.tree.flatten(structure) if leaf is not None]


def _is_array(value) -> bool:
    if isinstance(value, np.ndarray):
        return True
    try:
        import torch

        return isinstance(value, torch.Tensor)
    except ImportError:  # pragma: no cover
        return False


def is_array_data(*structures) -> bool:
    """True when every leaf of the given structures is an array or tensor."""
    leaves = [leaf for s in structures if s is not None for leaf in _leaves(s)]
    return bool(leaves) and all(_is_array(leaf) for leaf in leaves)


def num_rows(x, y=None, sample_weight=None) -> int:
    """The common number of rows of all arrays.

    Raises:
        ValueError: when the arrays differ in length, naming the lengths.
    """
    lengths = {}
    for name, s in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        if s is None:
            continue
        for leaf in _leaves(s):
            lengths.setdefault(name, set()).add(int(leaf.shape[0]))
    values = {n for v in lengths.values() for n in v}
    if len(values) != 1:
        detail = ", ".join(f"{k}: {sorted(v)}" for k, v in lengths.items())
        raise ValueError(
            "All inputs, targets and sample weights must have the same number "
            f"of rows. Received row counts {detail}."
        )
    return values.pop()


def _take(array, index):
    if isinstance(index, slice) or isinstance(array, np.ndarray):
        return array[index]
    import torch

    return array[torch.as_tensor(index)]


def rank_rows(step_start: int, step_stop: int, shares_for: Callable[[int], Sequence[int]],
              rank: int) -> tuple[int, int]:
    """The ``[begin, end)`` positions rank ``rank`` takes from one step."""
    shares = shares_for(step_stop - step_start)
    begin = step_start + sum(shares[:rank])
    return begin, begin + shares[rank]


def _make_dataset_class():
    import keras

    class ShardedArrays(keras.utils.PyDataset):
        """A ``PyDataset`` yielding this rank's share of each global batch.

        Args:
            x, y, sample_weight: arrays or structures of arrays, equal rows.
            batch_size: the global batch ``B``.
            shares: a callable giving the per-rank rows of a global batch of
                a given size (the shares may change between steps when
                rebalancing).
            rank: this process's rank.
            shuffle: ``True`` (rows), ``"batch"`` (within batches) or
                ``False``.
            seed: the seed of the permutation, equal on every rank.
        """

        def __init__(
            self,
            x,
            y=None,
            sample_weight=None,
            *,
            batch_size: int,
            shares: Callable[[int], Sequence[int]],
            rank: int,
            shuffle: bool | str = False,
            seed: int = 0,
        ) -> None:
            super().__init__(workers=1, use_multiprocessing=False)
            self.x, self.y, self.sample_weight = x, y, sample_weight
            self.rows = num_rows(x, y, sample_weight)
            self.batch_size = int(batch_size)
            self.shares = shares
            self.rank = rank
            self.shuffle = shuffle
            self.seed = int(seed)
            self.order: np.ndarray | None = None
            # The shares of the batch produced last: the training step reads
            # them instead of asking the other ranks (batches are produced
            # one at a time, right before their step).
            self.last_shares: list[int] | None = None

        def set_epoch(self, epoch: int) -> None:
            """Draws epoch ``epoch``'s row order (the same on every rank)."""
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

        @property
        def num_batches(self) -> int:
            return num_steps(self.rows, self.batch_size)

        def __len__(self) -> int:
            return self.num_batches

        def local_index(self, step: int):
            start = step * self.batch_size
            stop = min(start + self.batch_size, self.rows)
            shares = list(self.shares(stop - start))
            self.last_shares = shares
            begin = start + sum(shares[: self.rank])
            end = begin + shares[self.rank]
            if self.order is None:
                return slice(begin, end)
            return self.order[begin:end]

        def __getitem__(self, step: int):
            import keras

            if step >= self.num_batches:
                raise IndexError(step)
            index = self.local_index(step)
            pick = lambda s: None if s is None else keras.tree.map_structure(  # noqa: E731
                lambda a: _take(a, index), s
            )
            parts = [pick(self.x)]
            if self.y is not None or self.sample_weight is not None:
                parts.append(pick(self.y))
            if self.sample_weight is not None:
                parts.append(pick(self.sample_weight))
            return tuple(parts)

    return ShardedArrays


_CLASS = None


def ShardedArrays(*args, **kwargs):  # noqa: N802 - a class, built on first use
    """Builds a ``ShardedArrays`` dataset (Keras is imported on first use)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_dataset_class()
    return _CLASS(*args, **kwargs)


def cut_batch(batch, shares_for: Callable[[int], Sequence[int]], rank: int):
    """This rank's rows of one global batch (a tuple or a single structure).

    Returns:
        ``(local_batch, shares)``.
    """
    import keras

    leaves = [leaf for leaf in keras.tree.flatten(batch) if leaf is not None]
    if not leaves:
        raise ValueError(f"A batch must contain at least one array. Received: {type(batch).__name__} {batch!r:.100}")
    rows = int(leaves[0].shape[0])
    shares = list(shares_for(rows))
    begin = sum(shares[:rank])
    end = begin + shares[rank]
    local = keras.tree.map_structure(lambda a: None if a is None else a[begin:end], batch)
    return local, shares


def _standardize(batch):
    if isinstance(batch, list):
        return tuple(batch)
    return batch if isinstance(batch, (tuple, dict)) else (batch,)


def _make_pydataset_class():
    import keras

    class ShardedPyDataset(keras.utils.PyDataset):
        """Wraps a user's ``PyDataset``: every rank reads each global batch
        and keeps its share of the rows (exact; the loading runs on every
        rank).  Batch order is shuffled with a seed shared by all ranks."""

        def __init__(self, inner, *, shares, rank: int, shuffle: bool, seed: int) -> None:
            super().__init__(workers=1, use_multiprocessing=False)
            self.inner, self.shares, self.rank = inner, shares, rank
            self.shuffle, self.seed = bool(shuffle), int(seed)
            self.order: np.ndarray | None = None
            self.last_shares: list[int] | None = None

        def set_epoch(self, epoch: int) -> None:
            n = self.inner.num_batches
            self.order = (np.random.default_rng([self.seed, epoch]).permutation(n)
                          if self.shuffle and n else None)

        @property
        def num_batches(self):
            return self.inner.num_batches

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, index: int):
            if self.order is not None:
                index = int(self.order[index])
            local, shares = cut_batch(_standardize(self.inner[index]), self.shares, self.rank)
            self.last_shares = shares
            return local

        def on_epoch_end(self) -> None:
            self.inner.on_epoch_end()

    return ShardedPyDataset


def sharded_pydataset(inner, **kwargs):
    """A ``PyDataset`` giving this rank its share of each batch of ``inner``."""
    global _PY_CLASS
    if _PY_CLASS is None:
        _PY_CLASS = _make_pydataset_class()
    return _PY_CLASS(inner, **kwargs)


_PY_CLASS = None


def sharded_generator(generator, shares: Callable[[int], Sequence[int]], rank: int):
    """Yields this rank's share of each batch a Python generator yields."""
    for batch in generator:
        yield cut_batch(_standardize(batch), shares, rank)[0]


def sharded_dataloader(loader, shares: Callable[[int], Sequence[int]], rank: int):
    """A ``DataLoader`` giving this rank its share of each batch of ``loader``.

    It can be iterated once per epoch, like the loader it wraps.
    """
    import torch.utils.data as torch_data

    class _Cut(torch_data.IterableDataset):
        def __iter__(self):
            return sharded_generator(iter(loader), shares, rank)

        def __len__(self) -> int:
            return len(loader)

    return torch_data.DataLoader(_Cut(), batch_size=None)


def input_kind(x) -> str:
    """``"arrays"``, ``"pydataset"``, ``"generator"``, ``"dataloader"`` or ``"other"``."""
    import inspect

    if is_array_data(x):
        return "arrays"
    import keras

    if isinstance(x, keras.utils.PyDataset):
        return "pydataset"
    try:
        import torch.utils.data as torch_data

        if isinstance(x, torch_data.DataLoader):
            return "dataloader"
    except ImportError:  # pragma: no cover
        pass
    if inspect.isgenerator(x) or (hasattr(x, "__next__") and hasattr(x, "__iter__")):
        return "generator"
    return "other"
