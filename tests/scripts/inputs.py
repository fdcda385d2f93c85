"""Training fed by real loaders with workers, compared with one plain process by the tests.

    python inputs.py OUT.npz --plain          # one device, plain Keras
    multigpu run --devices cpu:0,cpu:1 --ratios 3,1 inputs.py OUT.npz

Three models, each trained 2 epochs at global batch 32 on 90 rows (the last
batch ragged) from one input form: a ``PyDataset`` read by 2 worker threads, a
``torch.utils.data.DataLoader`` with 2 worker processes and a seeded shuffle,
and a generator of both epochs' batches (``steps_per_epoch``), one of them of
another size.  Then ``evaluate`` on a ``PyDataset`` and ``predict`` on a
generator.  Writes every model's weights and History, the evaluation and the
predictions (rank R > 0: OUT.rankR.npz).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch
from seeding import set_random_seed

ROWS, BATCH = 90, 32


def make_data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64")
    return x, y


class Batches(keras.utils.PyDataset):
    """Slices of arrays, read by worker threads."""

    def __init__(self, x, y, batch, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return (len(self.x) + self.batch - 1) // self.batch

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]


class Rows(torch.utils.data.Dataset):
    """Map-style rows, loaded by the DataLoader's worker processes."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]), int(self.y[i])


def stream(x, y):
    """Both epochs' batches; the second epoch cuts its rows 40/30/20 (batches of another size)."""
    for start in range(0, ROWS, BATCH):
        yield x[start : start + BATCH], y[start : start + BATCH]
    for start, stop in ((0, 40), (40, 70), (70, 90)):
        yield x[start:stop], y[start:stop]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    x, y = make_data()
    rank, results = 0, {}
    model = None
    for kind in ("pydataset", "dataloader", "generator"):
        set_random_seed(6)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2, activation="softmax")])
        if not a.plain:
            import multigpu

            model = multigpu.parallelize(model, timeout=60)
            rank = multigpu.rank()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        steps = None
        if kind == "pydataset":
            # Keras's own enqueuer, restarted after the peek that builds the model, trains its first epoch on
            # batches of that peek (Keras 3.15): the one-device reference reads in order, without workers.
            data = Batches(x, y, BATCH, workers=1 if a.plain else 2)
        elif kind == "dataloader":
            data = torch.utils.data.DataLoader(Rows(x, y), batch_size=BATCH, shuffle=True, num_workers=2,
                                               generator=torch.Generator().manual_seed(11))
        else:
            data, steps = stream(x, y), 3
        history = model.fit(data, epochs=2, verbose=0, shuffle=False, steps_per_epoch=steps)
        results[kind] = np.concatenate([w.ravel() for w in model.get_weights()])
        results[f"{kind}_history"] = json.dumps(history.history)
    evaluation = model.evaluate(Batches(x, y, 25, workers=2), verbose=0, return_dict=True)
    results["evaluate"] = json.dumps({k: float(v) for k, v in evaluation.items()})
    results["predict"] = model.predict(((x[i : i + 20],) for i in range(0, ROWS, 20)), verbose=0)
    np.savez(a.out if rank == 0 else f"{a.out}.rank{rank}.npz", **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
