"""Global batches of arrays and tensors held in memory: each rank takes only its rows, nothing is read."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import keras
import numpy as np

from multigpu.data.forms import num_rows
from multigpu.planning.plan import StepPlan, num_steps

__all__ = ["ArraySource"]


def _to_floatx(a):
    """Floats that are not ``floatx`` become ``floatx``, as Keras's array adapter does (a memory-mapped
    array's rows when they are taken: converting it whole would read the whole file into memory)."""
    floatx = keras.backend.floatx()
    if isinstance(a, np.ndarray):
        if a.dtype.kind == "f" and a.dtype != np.dtype(floatx) and not _mapped(a):
            return a.astype(floatx)
        return a
    dtype = keras.backend.standardize_dtype(a.dtype)
    if keras.backend.is_float_dtype(dtype) and dtype != floatx:
        return keras.ops.cast(a, floatx)
    return a


def _mapped(a: np.ndarray) -> bool:
    """True for a memory-mapped array (``np.load(..., mmap_mode="r")``, ``np.memmap``) or a view of one."""
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = a.base if isinstance(a.base, np.ndarray) else None
    return False


def _take(array, index):
    """Rows ``index`` (a slice or an array of row numbers) of a NumPy array or a torch tensor, which takes a
    NumPy index as it is (on any device); a memory-mapped array's rows are read (only they) and become
    ``floatx`` here."""
    rows = array[index]
    if isinstance(array, np.ndarray) and _mapped(array):
        floatx = keras.backend.floatx()
        if rows.dtype.kind == "f" and rows.dtype != np.dtype(floatx):
            rows = rows.astype(floatx)
        elif isinstance(rows, np.memmap):
            rows = np.array(rows)  # a slice of a mapped file is still the file: the step gets memory of its own
    return rows


class ArraySource:
    """Arrays (alone, in lists, tuples, dicts): global step ``i`` is rows ``[i*B, (i+1)*B)`` of the order.

    The order is the data's, or a permutation drawn from the run's shared seed
    (the same on every rank) when shuffling; ``shuffle="batch"`` shuffles
    within each batch, as Keras does.
    """

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

    def batches(self, plan_of: Callable[..., StepPlan], first: int = 0) -> Iterator[tuple]:
        """This rank's rows of each global batch from step ``first`` on; ``plan_of(rows, again=cut)`` plans each
        (``cut(plan)`` cuts the same batch by another plan)."""
        for step in range(first, self.num_batches):
            start = step * self.batch_size
            cut = functools.partial(self._cut, start=start)
            yield cut(plan_of(min(self.batch_size, self.rows - start), again=cut))

    def _cut(self, plan: StepPlan, start: int) -> tuple:
        begin, end = plan.rows(plan.rank, start)
        index = slice(begin, end) if self.order is None else self.order[begin:end]
        parts = [None if p is None else _take(p, index) if type(p) is np.ndarray
                 else keras.tree.map_structure(lambda a, i=index: _take(a, i), p) for p in self.parts]
        return keras.utils.pack_x_y_sample_weight(*parts)  # as Keras's array adapter: x alone is not a tuple

    def close(self) -> None:
        pass
