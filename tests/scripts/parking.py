"""A device set aside and taken back: the result equals one device's.

    python parking.py OUT MODE [remeasure]

MODE ``one``: one device (the reference); ``two``: ``cpu:0`` and ``cpu:1`` with automatic shares (run with
``MULTIGPU_PARK=force``: the second device is set aside after each fit's first epoch and comes back at its end;
``force:1``: the first); ``three``: ``cpu:0``, ``cpu:1`` and ``cpu:2`` (``force:0,1``: the third set aside, the
first two left summing among themselves).  Fits at batch 64 for 3 epochs, then at 128 for 2 (the device comes back
at a larger batch), with validation, Adam (its state in parts where the run shards it) and a metric.  Each rank
writes its weights to ``OUT.rank<r>.npz`` and the weights it held at each epoch's end (as its callbacks see them) to
``OUT.rank<r>.epochs.npy``, and rank 0 the histories, its per-batch logs (fit, epoch, batch, loss, accuracy: what
its progress bar shows, also while it is set aside), each fit's last epoch report and the shares after it to
``OUT``, and a ``ModelCheckpoint`` at every epoch's end to ``OUT.fit<batch>-epoch<n>.keras``.

``remeasure``: the first fit runs 5 epochs, and the devices set aside are measured again after one epoch aside
(:data:`multigpu.balancing.parking.REMEASURE`, 8 in a real run; then twice as late): aside in epochs 2, 4 and
5 of the first fit and 2 of the second, back for epoch 3 (and at each fit's end).
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed

import multigpu

out, mode = sys.argv[1], sys.argv[2]
remeasure = sys.argv[3:] == ["remeasure"]
if remeasure:
    import multigpu.balancing.parking

    multigpu.balancing.parking.REMEASURE = 1
rng = np.random.default_rng(0)
x = rng.standard_normal((640, 32)).astype(np.float32)
y = (x[:, :10].argmax(axis=1) + (x[:, 10] > 1)).astype(np.int64) % 10
set_random_seed(0)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
if mode in ("two", "three"):
    devices = ["cpu:0", "cpu:1", "cpu:2"] if mode == "three" else ["cpu:0", "cpu:1"]
    model = multigpu.parallelize(model, devices=devices, ratios="auto")
model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
histories, reports, aside, held, batches = [], [], [], [], []


def seen(epoch, logs):  # the devices set aside in each epoch, as multigpu.state says; the weights callbacks see
    aside.append(multigpu.state(model).aside if mode != "one" else None)
    held.append(np.concatenate([np.ravel(w) for w in model.get_weights()]))


def shown(batch, logs):  # the per-batch logs, as the progress bar and the batch callbacks see them
    batches.append([len(histories), current[0], batch, float(logs["loss"]), float(logs["accuracy"])])


current = [0]
watch = keras.callbacks.LambdaCallback(on_epoch_end=seen, on_train_batch_end=shown,
                                       on_epoch_begin=lambda epoch, logs: current.__setitem__(0, epoch))
for batch, epochs in ((64, 5 if remeasure else 3), (128, 2)):
    h = model.fit(x[:512], y[:512], batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                  validation_data=(x[512:], y[512:]),
                  callbacks=[watch, keras.callbacks.ModelCheckpoint(f"{out}.fit{batch}-epoch{{epoch}}.keras")])
    histories.append(h.history)
    reports.append(multigpu.state(model).last_report if mode != "one" else None)  # the fit's last epoch
rank = multigpu.rank() if mode != "one" else 0
np.savez(f"{out}.rank{rank}.npz", *[np.asarray(w) for w in model.get_weights()])
np.save(f"{out}.rank{rank}.epochs.npy", np.stack(held))
if rank == 0:
    state = multigpu.state(model) if mode != "one" else None
    with open(out, "w") as f:
        json.dump({"histories": histories, "reports": reports, "aside": aside, "batches": batches,
                   "after": None if state is None else state.aside,
                   "ratios": None if state is None else list(state.ratios)}, f)
