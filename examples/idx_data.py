"""Fashion-MNIST and MNIST from their IDX files (gzip or not), no download.

Looked for, in order: the folder the caller names; Debian's
``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``,
install it with ``apt-get install dataset-fashion-mnist``); Keras's cache
(``~/.keras/datasets/fashion-mnist`` or ``~/.keras/datasets/mnist``).
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np

__all__ = ["DataNotFoundError", "find_idx_folder", "load_idx", "load_mnist_like"]

_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_DEBIAN = {"fashion_mnist": "/usr/share/datasets/fashion-mnist", "mnist": "/usr/share/datasets/mnist"}
_KERAS = {"fashion_mnist": "fashion-mnist", "mnist": "mnist"}
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class DataNotFoundError(FileNotFoundError):
    """The IDX files are nowhere we look; the message says how to get them."""


def load_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads one IDX file (``.gz`` or plain) into an array.

    Raises:
        ValueError: when the file is not IDX (bad magic number or size).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise ValueError(f"{path} is not an IDX file (magic number {data[:4].hex()})")
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    dtype = np.dtype(_DTYPES[data[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    body = data[4 + 4 * ndim :]
    if len(body) != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but the file has {len(body)}")
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def _file(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def find_idx_folder(name: str = "fashion_mnist", folder: str | os.PathLike | None = None) -> Path:
    """The first folder that holds all four IDX files of ``name``."""
    candidates = [Path(folder)] if folder else []
    candidates += [Path(_DEBIAN[name]), Path.home() / ".keras" / "datasets" / _KERAS[name]]
    for c in candidates:
        if all(_file(c, stem) for stem in _FILES.values()):
            return c
    raise DataNotFoundError(
        f"No {name} IDX files in {', '.join(str(c) for c in candidates)}. Install Debian's package "
        f"(`apt-get install dataset-{name.replace('_', '-')}`), or put the four files "
        f"({', '.join(v + '.gz' for v in _FILES.values())}) in a folder and name it."
    )


def load_mnist_like(name: str = "fashion_mnist", folder: str | os.PathLike | None = None):
    """Loads ``(x_train, y_train), (x_test, y_test)`` as uint8 images and labels.

    Args:
        name: ``"fashion_mnist"`` or ``"mnist"``.
        folder: a folder holding the IDX files (tried first).
    """
    if name not in _DEBIAN:
        raise ValueError(f"`name` must be 'fashion_mnist' or 'mnist'. Received: name={name!r}")
    where = find_idx_folder(name, folder)
    arrays = {key: load_idx(_file(where, stem)) for key, stem in _FILES.items()}
    for split_ in ("train", "test"):
        if len(arrays[f"{split_}_images"]) != len(arrays[f"{split_}_labels"]):
            raise ValueError(f"{where}: {split_} images and labels differ in number")
    return (arrays["train_images"], arrays["train_labels"]), (arrays["test_images"], arrays["test_labels"])
