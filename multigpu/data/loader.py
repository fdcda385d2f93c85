"""A ``torch.utils.data.DataLoader`` over a map-style dataset: each rank loads only its rows.

As DDP's ``DistributedSampler`` does, every rank runs its own copy of the
user's DataLoader, with the user's ``num_workers``, ``collate_fn``,
``pin_memory``, ``persistent_workers``, ``prefetch_factor``,
``worker_init_fn`` and ``generator``; only its batch sampler is multigpu's:
:class:`ShareBatchSampler` takes the user's global batches (the user's
``batch_sampler``, so ``batch_size``, ``drop_last``, ``shuffle`` and custom
samplers keep their meaning) and gives this rank the indices of its share of
each one.  Unlike ``DistributedSampler``, the cut is by the current shares,
which may differ between ranks and move between steps.

The DataLoader asks its sampler for batches ahead of the training loop (two
per worker by default), so a batch's plan is made when its indices are drawn,
a few steps before it is trained on; the plans queue up in order for the
training step.  Every rank draws at the same points of the loop, so the ranks
agree on every plan.  A rank with no rows in a step loads the global batch's
first item and drops it, so that the collated batch keeps its structure.

Every rank must draw the same global batches: at the start of each pass the
ranks compare a digest of them, and where they differ (an unseeded
``shuffle=True``) every rank takes rank 0's.

After a lost rank, a training batch planned with a share for it (the one
being stepped on, and those drawn ahead) is cut again by the shares of the
ranks left: this rank's new rows are loaded in its own process, collated
as the DataLoader does.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import pickle
import warnings
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from multigpu.data.forms import batch_rows, standardize
from multigpu.planning.plan import StepPlan

__all__ = ["LoaderSource", "ShareBatchSampler", "can_cut_by_index"]

# The DataLoader arguments the copy keeps; its batch sampler is multigpu's and its order always the sampler's.
_KEPT = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
         "generator", "prefetch_factor", "persistent_workers", "pin_memory_device")


def can_cut_by_index(loader) -> bool:
    """True for a plain DataLoader over a map-style dataset with a finite batch sampler."""
    import torch.utils.data as tud

    if type(loader) is not tud.DataLoader or isinstance(loader.dataset, tud.IterableDataset):
        return False
    if loader.batch_sampler is None:  # batch_size=None: the dataset gives whole batches
        return False
    try:
        len(loader.batch_sampler)
    except TypeError:
        return False
    return True


class ShareBatchSampler:
    """The indices of this rank's share of each of the user's global batches.

    Args:
        batches: the user's batch sampler (global batches of indices).
        agree: ``agree(flat, lengths)`` returns the global batches every rank
            uses (rank 0's where the ranks drew different ones).
        load: ``load(indices)`` loads and collates items in this process
            (a batch cut again by another plan after a lost rank).
    """

    def __init__(self, batches, agree: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
                 load: Callable[[list], object] | None = None) -> None:
        self.batches = batches
        self.agree = agree
        self.load = load
        self.plan_of: Callable[[int], StepPlan] | None = None
        self.plans: deque[StepPlan] = deque()  # plans of the batches drawn, in order, for the loader's output

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        self.plans.clear()
        batches = [list(b) for b in self.batches]
        lengths = np.asarray([len(b) for b in batches], dtype=np.int64)
        items = [i for b in batches for i in b]
        try:
            flat = np.asarray(items, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):  # keys that are not integers (a dataset indexed otherwise)
            flat = np.empty(len(items), dtype=object)
            flat[:] = items
        flat, lengths = self.agree(flat, lengths)
        start = 0
        for length in lengths.tolist():
            indices = flat[start : start + length]
            start += length
            again = None if self.load is None else functools.partial(self._again, indices)
            plan = self.plan_of(length, again=again)  # type: ignore[misc]
            self.plans.append(plan)
            begin, end = plan.rows(plan.rank)
            yield (indices[begin:end] if end > begin else indices[:1]).tolist()


    def _again(self, indices: np.ndarray, plan: StepPlan):
        """This rank's rows of a global batch by another ``plan``, loaded here (after a lost rank)."""
        begin, end = plan.rows(plan.rank)
        batch = standardize(self.load((indices[begin:end] if end > begin else indices[:1]).tolist()))
        return batch if end > begin else _no_rows(batch)


def _no_rows(batch):
    import keras

    rows = batch_rows(batch)
    return keras.tree.map_structure(
        lambda a: a[:0] if hasattr(a, "shape") and len(a.shape) and a.shape[0] == rows else a, batch)


def _agree_with(comm, rank: int) -> Callable:
    said = []

    def agree(flat: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        data = pickle.dumps(flat.tolist()) if flat.dtype == object else flat.tobytes()
        digest = hashlib.blake2b(data + b"|" + lengths.tobytes(), digest_size=8).hexdigest()
        if len({d for d in comm.gather_objects(digest, "comparing the DataLoader's batches") if d is not None}) == 1:
            return flat, lengths
        if rank == 0 and not said:
            said.append(True)
            warnings.warn("multigpu: the DataLoader drew different batches on the ranks (a shuffle without a "
                          "seed); every rank follows rank 0's. To draw the order of a one-device run, give the "
                          "DataLoader a seeded generator: generator=torch.Generator().manual_seed(S).",
                          stacklevel=2)
        return comm.gather_objects((flat, lengths) if rank == 0 else None, "sharing rank 0's batches")[0]

    return agree


class LoaderSource:
    """A map-style DataLoader cut by index (see the module docstring).

    Args:
        loader: the user's DataLoader (:func:`can_cut_by_index` is true).
        comm: the run's collectives.
        rank: this rank.
    """

    def __init__(self, loader, comm, rank: int) -> None:
        import torch.utils.data as tud

        self.loader = loader
        self.sampler = ShareBatchSampler(loader.batch_sampler, _agree_with(comm, rank), self._load)
        params = inspect.signature(tud.DataLoader.__init__).parameters
        kept = {k: getattr(loader, k) for k in _KEPT if k in params and hasattr(loader, k)}
        if not kept.get("num_workers"):
            kept.pop("prefetch_factor", None)
            kept.pop("persistent_workers", None)
        self.local = tud.DataLoader(loader.dataset, batch_sampler=self.sampler, **kept)
        self.batch_size = loader.batch_size

    plans_ahead = True  # batches are planned when their indices are drawn, a few steps ahead of the step

    @property
    def num_batches(self) -> int:
        return len(self.sampler)

    def _load(self, indices: list):
        """Items ``indices`` of the dataset, collated as the DataLoader does, loaded in this process."""
        return self.local.collate_fn([self.loader.dataset[i] for i in indices])

    def set_epoch(self, epoch: int) -> None:
        pass  # the user's sampler draws each pass's order itself, as on one device

    def batches(self, plan_of: Callable[[int], StepPlan]) -> Iterator:
        """This rank's batches of one pass; the DataLoader's iterator starts now, as Keras starts its own."""
        self.sampler.plan_of = plan_of
        return self._batches(iter(self.local), self.sampler.plans)

    @staticmethod
    def _batches(iterator, plans) -> Iterator:
        for loaded in iterator:
            plan = plans.popleft()
            batch = standardize(loaded)
            yield _no_rows(batch) if plan.local == 0 else batch  # an empty share loaded a placeholder row

    def close(self) -> None:
        pass
