"""Each rank's share of every global batch, as a Keras ``DataAdapter``.

A global batch goes from the user's data to this rank's rows in one place:
:class:`ShardedData` asks the planner (the balancer's) for the batch's plan
and the source (:mod:`multigpu.data`) cuts this rank's contiguous run of rows
out of it.  For training data the plan is queued for the training step, which
weights its gradients by it; for evaluation and prediction it is not.
``ShardedData`` is a Keras ``DataAdapter``, which Keras's ``fit``/``evaluate``/
``predict`` take as it is, so Keras's own loop runs unchanged, once per global
batch on every rank (an empty share is an empty batch), and callbacks fire as
they would on one device.  The time the loop waits for each batch is measured
here, as the step's input time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import keras
import numpy as np

from multigpu import backend, membership
from multigpu._keras import compat as _compat
from multigpu.planning.plan import StepPlan, StepPlanner

__all__ = ["ShardedData"]


def _to_backend(batch, numpy_passes: bool = False):
    """``batch`` as the backend's tensors; with ``numpy_passes`` (JAX's iterator) NumPy arrays stay as they are,
    as in Keras's own JAX iterator: a compiled step takes them as they are, with no conversion in Python first
    (which cost a tenth of a small step's time)."""
    if numpy_passes and all(a is None or type(a) is np.ndarray for a in (batch if type(batch) is tuple else (batch,))):
        return batch  # the common case, at every step: NumPy rows as they are
    numpy_first = not backend.facts().takes_torch_tensors

    def convert(a):
        if a is None:
            return a
        if numpy_first and type(a).__module__.startswith("torch"):
            a = a.numpy()  # a DataLoader's tensors, for a backend that does not take them (JAX)
        if numpy_passes and isinstance(a, np.ndarray):
            return a
        return keras.ops.convert_to_tensor(a)

    return keras.tree.map_structure(convert, batch)


_Base = _compat.DataAdapter if _compat.DataAdapter is not None else object


class ShardedData(_Base):  # type: ignore[misc,valid-type]
    """A Keras ``DataAdapter`` yielding this rank's share of each global batch.

    Args:
        source: the global batches (a source of :mod:`multigpu.data`).
        planner: the balancer's planner.
        training: queue each batch's plan for the training step.
        input_time: called with the seconds the loop waited for each batch.
    """

    def __init__(self, source, planner: StepPlanner, *, training: bool,
                 input_time: Callable[[float], None] | None = None) -> None:
        self.source = source
        self.planner = planner
        self.training = training
        self.input_time = input_time
        self.epoch = -1
        self.plans: list[StepPlan] = []  # the plans of the pass read last, for prediction
        self._resume: tuple[int, int] | None = None  # (epoch, step): a rank that came back starts there

    def resume_at(self, epoch: int, step: int) -> None:
        """Epoch ``epoch``'s passes start at step ``step`` (a rank that came back after a loss; arrays only)."""
        self._resume = (epoch, step)

    def first_step(self, epoch: int) -> int:
        """The step epoch ``epoch``'s pass starts at (0 but on a rank that came back, in its first epoch)."""
        return self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0

    def set_epoch(self, epoch: int) -> None:
        """Draws epoch ``epoch``'s order (the same on every rank)."""
        self.epoch = epoch
        self.source.set_epoch(epoch)

    def _iterate(self, convert: bool, numpy_passes: bool = False) -> Iterator[tuple]:
        """A pass over the source, started where Keras's torch trainer starts one over its own adapter (a
        DataLoader's iterator, and the draws of its shuffle, begin at this call)."""
        if self.training:
            self.planner.reset()  # plans of a pass Keras left early (a peek to build the model) are never trained on
        plans: list[StepPlan] = []

        def plan_of(total: int, again=None) -> StepPlan:
            if not self.training and getattr(self.source, "plans_ahead", False):
                again = None  # a batch planned ahead is not the one being evaluated: it cannot be cut again
            if again is not None and convert:
                again = lambda plan, cut=again: _to_backend(cut(plan), numpy_passes)  # noqa: E731
            plan = self.planner.plan(total, for_step=self.training, again=again)
            plans.append(plan)
            return plan

        first = self.first_step(self.epoch)
        batches = self.source.batches(plan_of, first=first) if first else self.source.batches(plan_of)
        return self._timed(batches, plans, convert, numpy_passes)

    def _lazy(self, convert: bool, numpy_passes: bool = False) -> Iterator[tuple]:
        """A pass started at its first batch, as Keras's numpy and JAX iterators start theirs."""
        yield from self._iterate(convert, numpy_passes)

    def _timed(self, batches: Iterator, plans: list[StepPlan], convert: bool,
               numpy_passes: bool = False) -> Iterator[tuple]:
        self.plans = plans  # the pass that is read (Keras also starts passes it never reads)
        try:
            while True:
                start = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                membership.at("input", self.planner.rank)
                batch = _to_backend(batch, numpy_passes) if convert else batch
                if self.input_time is not None:
                    self.input_time(time.perf_counter() - start)
                yield batch
        finally:
            if hasattr(batches, "close"):
                batches.close()

    def get_torch_dataloader(self):
        return self._iterate(convert=True)

    def get_numpy_iterator(self):
        return self._lazy(convert=False)

    def get_jax_iterator(self, super_batch=None):
        # Keras 3.16 asks for ``steps_per_execution`` batches stacked into one; multigpu's JAX step takes its
        # batches one at a time (each is a step of its own: plan, collective, timing), so they come unstacked.
        return self._lazy(convert=True, numpy_passes=True)

    def get_tf_dataset(self):
        from multigpu.backend.tensorflow.feeding import dataset

        return dataset(lambda: self._iterate(convert=False))

    @property
    def num_batches(self):
        return self.source.num_batches

    @property
    def batch_size(self):
        return getattr(self.source, "batch_size", None)

    @property
    def has_partial_batch(self):
        rows, size = getattr(self.source, "rows", None), self.batch_size
        return None if rows is None or size is None else rows % size != 0

    @property
    def partial_batch_size(self):
        rows, size = getattr(self.source, "rows", None), self.batch_size
        return None if rows is None or size is None or rows % size == 0 else rows % size

    def on_epoch_begin(self):
        if hasattr(self.source, "on_epoch_begin"):
            self.source.on_epoch_begin()

    def on_epoch_end(self):
        if hasattr(self.source, "on_epoch_end"):
            self.source.on_epoch_end()

    def close(self) -> None:
        """Ends the source's readers (at the end of the call)."""
        self.source.close()
