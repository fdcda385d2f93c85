"""Each rank's share of every global batch, as a Keras ``DataAdapter``; checks of the user's data.

A global batch goes from the user's data to this rank's rows in one place:
:class:`ShardedData` asks the planner (the balancer's) for the batch's plan
and cuts this rank's contiguous run of rows out of it.  For training data the
plan is queued for the training step, which weights its gradients by it; for
evaluation and prediction it is not.  ``ShardedData`` is a Keras
``DataAdapter``, which Keras's ``fit``/``evaluate``/``predict`` take as it is,
so Keras's own loop runs unchanged, once per global batch on every rank (an
empty share is an empty batch), and callbacks fire as they would on one device.
The global batches of each input form (arrays, ``PyDataset``, generators and
``DataLoader``) come from :mod:`multigpu.keras.sources`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import keras
import numpy as np

from multigpu.keras import _compat
from multigpu.planning.plan import StepPlan, StepPlanner

__all__ = ["ShardedData", "input_kind", "is_array_data", "num_rows", "validation_split"]


def _leaves(structure) -> list:
    return [leaf for leaf in keras.tree.flatten(structure) if leaf is not None]


def _is_array(value) -> bool:
    if isinstance(value, np.ndarray):
        return True
    return type(value).__module__.startswith("torch") and hasattr(value, "shape") and hasattr(value, "dtype")


def is_array_data(*structures) -> bool:
    """True when every leaf of the given structures is an array or tensor."""
    leaves = [leaf for s in structures if s is not None for leaf in _leaves(s)]
    return bool(leaves) and all(_is_array(leaf) for leaf in leaves)


def num_rows(x, y=None, sample_weight=None) -> int:
    """The common number of rows of all arrays.

    Raises:
        ValueError: when the arrays differ in length, naming the lengths.
    """
    lengths: dict[str, set[int]] = {}
    for name, s in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        for leaf in _leaves(s) if s is not None else []:
            lengths.setdefault(name, set()).add(int(leaf.shape[0]))
    values = {n for v in lengths.values() for n in v}
    if len(values) != 1:
        detail = ", ".join(f"{k}: {sorted(v)}" for k, v in lengths.items())
        raise ValueError(
            f"All inputs, targets and sample weights must have the same number of rows. Received row counts {detail}."
        )
    return values.pop()


def input_kind(x) -> str:
    """``"arrays"``, ``"pydataset"``, ``"generator"``, ``"dataloader"`` or ``"other"``."""
    if is_array_data(x):
        return "arrays"
    if isinstance(x, keras.utils.PyDataset):
        return "pydataset"
    if type(x).__module__.startswith("torch.utils.data") or any(
        c.__module__.startswith("torch.utils.data") and c.__name__ == "DataLoader" for c in type(x).__mro__
    ):
        return "dataloader"
    if inspect.isgenerator(x) or (hasattr(x, "__next__") and hasattr(x, "__iter__")):
        return "generator"
    return "other"


def validation_split(arrays: tuple, fraction: float) -> tuple[tuple, tuple]:
    """The last ``fraction`` of the rows as validation data, as Keras's ``validation_split`` does."""
    rows = num_rows(*arrays)
    split_at = int(np.floor(rows * (1.0 - fraction)))
    if split_at in (0, rows):
        raise ValueError(f"Training data contains {rows} samples, which is not sufficient to split it into a "
                         f"validation and training set as specified by `validation_split={fraction}`.")

    def cut(s, part):
        return None if s is None else keras.tree.map_structure(lambda a: a[part], s)

    return (tuple(cut(a, slice(0, split_at)) for a in arrays), tuple(cut(a, slice(split_at, rows)) for a in arrays))


def _to_backend(batch: tuple) -> tuple:
    return keras.tree.map_structure(
        lambda a: a if a is None else keras.ops.convert_to_tensor(a), batch, none_is_leaf=False
    )


_Base = _compat.DataAdapter if _compat.DataAdapter is not None else object


class ShardedData(_Base):  # type: ignore[misc,valid-type]
    """A Keras ``DataAdapter`` yielding this rank's share of each global batch.

    Args:
        source: the global batches (see the module docstring).
        planner: the balancer's planner.
        training: queue each batch's plan for the training step.
    """

    def __init__(self, source, planner: StepPlanner, *, training: bool) -> None:
        self.source = source
        self.planner = planner
        self.training = training
        self.epoch = -1
        self.plans: list[StepPlan] = []  # this epoch's, for prediction

    def _plan(self, total: int) -> StepPlan:
        plan = self.planner.plan(total, for_step=self.training)
        self.plans.append(plan)
        return plan

    def set_epoch(self, epoch: int) -> None:
        """Draws epoch ``epoch``'s order (the same on every rank)."""
        self.epoch = epoch
        self.source.set_epoch(epoch)

    def _iterate(self, convert: bool) -> Iterator[tuple]:
        self.plans = []
        for batch in self.source.batches(self._plan):
            yield _to_backend(batch) if convert else batch

    def get_torch_dataloader(self):
        return self._iterate(convert=True)

    def get_numpy_iterator(self):
        return self._iterate(convert=False)

    def get_jax_iterator(self):
        return self._iterate(convert=True)

    def get_tf_dataset(self):  # pragma: no cover - multigpu runs on torch and JAX
        raise NotImplementedError("multigpu does not feed the TensorFlow backend")

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
        if self.training:
            self.planner.reset()  # batches cut by a peek (Keras builds the model from one) are not trained on
        if hasattr(self.source, "on_epoch_begin"):
            self.source.on_epoch_begin()

    def on_epoch_end(self):
        if hasattr(self.source, "on_epoch_end"):
            self.source.on_epoch_end()
