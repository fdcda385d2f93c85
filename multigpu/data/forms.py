"""The input forms Keras takes, told apart, and the few facts every source needs of a batch.

Backend-neutral: NumPy, Keras's tree utilities, and the class names of torch's
and TensorFlow's data types (neither is imported here).
"""

from __future__ import annotations

import inspect

import keras
import numpy as np

__all__ = ["as_arrays", "batch_rows", "input_kind", "is_array_data", "leaves", "num_rows", "standardize",
           "validation_split"]


def leaves(structure) -> list:
    """The non-None leaves of a structure of arrays."""
    return [leaf for leaf in keras.tree.flatten(structure) if leaf is not None]


def _is_array(value) -> bool:
    if isinstance(value, np.ndarray):
        return True
    return type(value).__module__.startswith("torch") and hasattr(value, "shape") and hasattr(value, "dtype")


def _to_numpy(leaf):
    """A pandas DataFrame or Series, a ``jax.Array`` or a TensorFlow tensor as a NumPy array (as Keras's array
    adapter takes them); anything else as it is."""
    module = type(leaf).__module__
    if module.startswith("pandas") and hasattr(leaf, "to_numpy"):
        return leaf.to_numpy()
    if module.startswith(("jax", "jaxlib", "tensorflow")) and hasattr(leaf, "shape") and hasattr(leaf, "dtype") \
            and hasattr(leaf, "__array__"):
        return np.asarray(leaf)
    return leaf


def as_arrays(*structures) -> tuple:
    """The structures with every pandas, JAX and TensorFlow array in them as a NumPy array, so that all of them
    take the arrays' path (split by rows, read once per machine)."""
    return tuple(None if s is None else keras.tree.map_structure(_to_numpy, s) for s in structures)


def is_array_data(*structures) -> bool:
    """True when every leaf of the given structures is an array or tensor."""
    found = [leaf for s in structures if s is not None for leaf in leaves(s)]
    return bool(found) and all(_is_array(leaf) for leaf in found)


def num_rows(x, y=None, sample_weight=None) -> int:
    """The common number of rows of all arrays.

    Raises:
        ValueError: when the arrays differ in length, naming the lengths.
    """
    lengths: dict[str, set[int]] = {}
    for name, s in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        for leaf in leaves(s) if s is not None else []:
            lengths.setdefault(name, set()).add(int(leaf.shape[0]))
    values = {n for v in lengths.values() for n in v}
    if len(values) != 1:
        detail = ", ".join(f"{k}: {sorted(v)}" for k, v in lengths.items())
        raise ValueError(
            f"All inputs, targets and sample weights must have the same number of rows. Received row counts {detail}."
        )
    return values.pop()


def _is_torch_loader(x) -> bool:
    return type(x).__module__.startswith("torch.utils.data") or any(
        c.__module__.startswith("torch.utils.data") and c.__name__ == "DataLoader" for c in type(x).__mro__
    )


def _is_grain_dataset(x) -> bool:
    return any(c.__module__.startswith("grain") and c.__name__ in ("MapDataset", "IterDataset")
               for c in type(x).__mro__)


def _is_tf_dataset(x) -> bool:
    return any(c.__module__.startswith("tensorflow.python.data") and c.__name__ in ("DatasetV2", "DatasetV1")
               for c in type(x).__mro__)


def input_kind(x) -> str:
    """``"arrays"``, ``"pydataset"``, ``"generator"``, ``"dataloader"``, ``"grain"``, ``"tf.data"`` or ``"other"``.

    A grain dataset is what keras-hub's tasks build in their own ``fit``
    (batched and preprocessed), and one Keras itself takes; a ``tf.data``
    dataset is what Keras's ``*_dataset_from_directory`` utilities return.
    """
    if is_array_data(x):
        return "arrays"
    if isinstance(x, keras.utils.PyDataset):
        return "pydataset"
    if _is_torch_loader(x):
        return "dataloader"
    if _is_grain_dataset(x):
        return "grain"
    if _is_tf_dataset(x):
        return "tf.data"
    if inspect.isgenerator(x) or (hasattr(x, "__next__") and hasattr(x, "__iter__")):
        return "generator"
    return "other"


def standardize(batch):
    """A batch as Keras's dataset adapters pass it on: a dict as it is, a list as a tuple, an array as ``(x,)``."""
    if isinstance(batch, list):
        return tuple(batch)
    return batch if isinstance(batch, (tuple, dict)) else (batch,)


def batch_rows(batch) -> int:
    """Rows of a batch (of its first array).

    Raises:
        ValueError: for a batch without arrays.
    """
    found = [leaf for leaf in leaves(batch) if hasattr(leaf, "shape") and len(leaf.shape)]
    if not found:
        raise ValueError(f"A batch must contain at least one array. Received: {type(batch).__name__} {batch!r:.100}")
    return int(found[0].shape[0])


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
