"""Input pipelines that fail, for the tests: each run must end cleanly, naming the rank and the error.

    multigpu run --devices cpu:0,cpu:1 input_failures.py MODE

Modes:
  pyds_worker    a PyDataset read by 2 worker threads raises OSError at global batch 3
  loader_worker  a DataLoader's worker process raises OSError at item 50
  short          (two machines under torchrun) machine 1's generator ends two batches early
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch

import multigpu


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 3:
            raise OSError(f"cannot read batch {i}")
        return np.ones((16, 4), "float32"), np.zeros(16, "int64")


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 128

    def __getitem__(self, i):
        if i == 50:
            raise OSError(f"cannot read item {i}")
        return torch.ones(4), 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["pyds_worker", "loader_worker", "short"])
    a = p.parse_args()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model = multigpu.parallelize(model, devices="auto", timeout=30)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    if a.mode == "pyds_worker":
        data = Batches(workers=2)
    elif a.mode == "loader_worker":
        data = torch.utils.data.DataLoader(Items(), batch_size=16, num_workers=2)
    else:
        batches = 6 if multigpu.rank() == 0 else 4
        data = ((np.ones((16, 4), "float32"), np.zeros(16, "int64")) for _ in range(batches))
    model.fit(data, epochs=2, verbose=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
