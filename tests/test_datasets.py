"""The IDX loader, on small IDX files the tests write."""

import gzip
import struct

import numpy as np
import pytest

from examples.idx_data import DataNotFoundError, find_idx_folder, load_idx, load_mnist_like


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
def test_reads_what_was_written(tmp_path, compress):
    arrays = make_set(tmp_path, compress=compress)
    (x, y), (xt, yt) = load_mnist_like("fashion_mnist", folder=tmp_path)
    np.testing.assert_array_equal(x, arrays["train"][0])
    np.testing.assert_array_equal(y, arrays["train"][1])
    np.testing.assert_array_equal(xt, arrays["t10k"][0])
    assert yt.shape == (3,) and x.dtype == np.uint8


def test_other_dtypes(tmp_path):
    values = np.arange(12, dtype=">f4").reshape(3, 4)
    write_idx(tmp_path / "f", values, compress=False)
    np.testing.assert_array_equal(load_idx(tmp_path / "f"), values.astype("float32"))


def test_bad_files_and_missing_data_give_clear_errors(tmp_path, monkeypatch):
    (tmp_path / "bad").write_bytes(b"\x12\x34\x56\x78rest")
    with pytest.raises(ValueError, match="not an IDX file"):
        load_idx(tmp_path / "bad")
    short = bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10) + b"\x00" * 3
    (tmp_path / "short").write_bytes(short)
    with pytest.raises(ValueError, match="header says"):
        load_idx(tmp_path / "short")
    monkeypatch.setattr("examples.idx_data._DEBIAN", {"fashion_mnist": str(tmp_path / "no"), "mnist": "x"})
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(DataNotFoundError, match="apt-get install dataset-fashion-mnist"):
        find_idx_folder("fashion_mnist", tmp_path / "empty")
    with pytest.raises(ValueError, match="'fashion_mnist' or 'mnist'"):
        load_mnist_like("train_images")
