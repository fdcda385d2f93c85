"""Trains issue 64's MLP (784-512-512-10, ReLU, logits, SGD 0.01) at several splits of a batch of 64 on two
devices, one model per split in one run, and checks every step against one device's step from the same weights.

    multigpu run --devices cpu:0,cpu:1 splits.py OUT.json --splits 37,27 29,35 38,26 --rows 3840 --epochs 3
    python splits.py OUT.json --plain --rows 3840 --epochs 3      # one device, no multigpu: the end-to-end reference

Rank 0 keeps a plain Keras copy of the model: before each step it takes the parallel model's weights, then
makes Keras's own ``train_on_batch`` on the whole global batch, and compares its update with the parallel
step's (per weight tensor, the largest difference beyond the new weight's own rounding, over the largest
update).  That is the promise, step by step:
the N devices' step is one device's step from the same weights, to float rounding.  The end-to-end weights go
to OUT too; over many steps they also carry the model's own float spread (a ReLU whose input lands within
rounding of zero flips with any change of summation order, on one device too: docs/concepts/exactness.md).
Rank 0 also trains a second plain copy alone from the start: per step, how far the parallel weights are from
it (``parts``) and the ReLU input nearest zero on that step's batch (``margins``, relative to its layer's
largest), so that a test can tell where the two runs part and whether a ReLU input lay within reach there.
The weights of each split after each epoch are written to ``OUT.<split>.epochN.npz`` (``OUT.plain.epochN.npz``
for the plain run).
"""

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
from seeding import set_random_seed

BATCH = 64


def build() -> keras.Model:
    set_random_seed(1)
    return keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])


def compile_(model: keras.Model) -> None:
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def data(rows: int):
    rng = np.random.default_rng(0)
    return rng.random((rows, 784), dtype=np.float32), rng.integers(0, 10, rows)


def relu_margin(weights: list, x: np.ndarray) -> float:
    """The ReLU input nearest zero on batch ``x``, relative to its layer's largest, for the MLP's ``weights``."""
    margin, h = 1.0, x
    for kernel, bias in zip(weights[0:4:2], weights[1:4:2]):
        z = np.abs(h @ kernel + bias)
        margin = min(margin, float(z.min() / z.max()))
        h = np.maximum(h @ kernel + bias, 0)
    return margin


class StepByStep(keras.callbacks.Callback):
    """One device's step from the parallel model's weights, beside each parallel step (shuffle=False)."""

    def __init__(self, x, y) -> None:
        super().__init__()
        self.x, self.y = x, y
        self.reference = build()
        compile_(self.reference)
        self.before: list | None = None
        self.worst = 0.0
        self.worst_step = -1
        self.steps = 0
        # one device's own run beside it, from the start: where the two part, and how near zero a ReLU input came
        self.alone = build()
        compile_(self.alone)
        self.parts: list[float] = []
        self.margins: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.before = [np.array(w) for w in self.model.get_weights()]

    def on_train_batch_end(self, batch, logs=None):
        after = [np.array(w) for w in self.model.get_weights()]
        self.reference.set_weights(self.before)
        rows = slice(batch * BATCH, (batch + 1) * BATCH)
        self.reference.train_on_batch(self.x[rows], self.y[rows])
        for w0, w1, ref in zip(self.before, after, self.reference.get_weights()):
            scale = float(np.max(np.abs(ref - w0)))
            if scale > 0:
                # less the rounding of the new weight itself (one unit in its last place; w - lr * g rounds)
                err = float(np.max(np.maximum(np.abs(w1 - ref) - np.spacing(np.abs(ref)), 0))) / scale
                if err > self.worst:
                    self.worst, self.worst_step = err, self.steps
        self.margins.append(relu_margin(self.alone.get_weights(), self.x[rows]))
        self.alone.train_on_batch(self.x[rows], self.y[rows])
        self.parts.append(max(float(np.max(np.abs(w - a)) / np.max(np.abs(a)))
                              for w, a in zip(after, self.alone.get_weights())))
        self.steps += 1


class EpochWeights(keras.callbacks.Callback):
    """Writes the weights after each epoch to ``PREFIX.epochN.npz``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def on_epoch_end(self, epoch, logs=None):
        np.savez(f"{self.prefix}.epoch{epoch + 1}.npz", *self.model.get_weights())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--splits", nargs="*", default=[], help="rows of each device per batch of 64, e.g. 37,27")
    p.add_argument("--rows", type=int, default=3840)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--policy", default=None, help="a Keras dtype policy, e.g. mixed_float16")
    a = p.parse_args()
    if a.policy:
        keras.mixed_precision.set_global_policy(a.policy)
    x, y = data(a.rows)
    results, rank = {}, 0
    for split in ["plain"] if a.plain else a.splits:
        callbacks = []
        if not a.plain:  # every rank builds the reference, so that the models' variable names agree across ranks
            step_by_step = StepByStep(x, y)
        model = build()
        if not a.plain:
            import multigpu

            sizes = [int(s) for s in split.split(",")]
            assert sum(sizes) == BATCH, sizes
            model = multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], ratios=sizes)
            rank = multigpu.rank()
            if rank == 0:
                callbacks = [step_by_step]
        if rank == 0:
            callbacks.append(EpochWeights(f"{a.out}.{split}"))
        compile_(model)
        history = model.fit(x, y, batch_size=BATCH, epochs=a.epochs, shuffle=False, verbose=0, callbacks=callbacks)
        if not a.plain:
            shares = multigpu.state(model).shares(BATCH)
            assert list(shares) == sizes, (shares, sizes)  # the split asked for is the split that ran
        results[split] = {"loss": history.history["loss"]}
        if not a.plain and rank == 0:
            results[split].update(step_error=callbacks[0].worst, worst_step=callbacks[0].worst_step,
                                  steps=callbacks[0].steps, parts=callbacks[0].parts,
                                  margins=callbacks[0].margins)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
