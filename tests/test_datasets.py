"""The examples' Fashion-MNIST reader (``examples/_common.py``), on small IDX files the tests write."""

import gzip
import struct

import numpy as np
import pytest

from examples import _common


def write_idx(path, array: np.ndarray, compress: bool) -> None:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D}
    array = np.ascontiguousarray(array)
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def make_set(folder, rows=(7, 3), compress=True):
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in zip(("train", "t10k"), rows):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        write_idx(folder / f"{split}-images-idx3-ubyte", images, compress)
        write_idx(folder / f"{split}-labels-idx1-ubyte", labels, compress)
        arrays[split] = (images, labels)
    return arrays


@pytest.mark.parametrize("compress", [True, False])
def test_reads_the_first_folder_that_holds_the_four_files(tmp_path, monkeypatch, compress):
    (tmp_path / "partial").mkdir()
    (tmp_path / "full").mkdir()
    write_idx(tmp_path / "partial" / "train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8), compress)
    arrays = make_set(tmp_path / "full", compress=compress)
    monkeypatch.setattr(_common, "FASHION_MNIST", [str(tmp_path / "missing"), str(tmp_path / "partial"),
                                                   str(tmp_path / "full")])
    (x_train, y_train), (x_test, y_test) = _common.read_fashion_mnist()
    np.testing.assert_array_equal(x_train, arrays["train"][0])
    np.testing.assert_array_equal(y_train, arrays["train"][1])
    np.testing.assert_array_equal(x_test, arrays["t10k"][0])
    np.testing.assert_array_equal(y_test, arrays["t10k"][1])
    assert x_train.shape == (7, 28, 28) and y_test.shape == (3,)


def test_no_folder_with_the_four_files_reads_as_none(tmp_path, monkeypatch):
    monkeypatch.setattr(_common, "FASHION_MNIST", [str(tmp_path / "missing"), str(tmp_path)])
    assert _common.read_fashion_mnist() is None
