"""Trains a small classifier with validation and a checkpoint every epoch; writes the final weights, the
History and the run's lost devices to an .npz file (from the rank that writes).

    python faults.py OUT.npz --devices cpu:0,cpu:1,cpu:2 --ratios 1,2,5 --min-devices 1
    python faults.py OUT.npz --plain        # one device, no multigpu
    python faults.py OUT.npz ... --input pydataset   # the same batches from a PyDataset (or a generator)

``MULTIGPU_FAULT`` (see multigpu.membership) chooses which ranks die where.
"""

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed


class OwnStep(keras.Model):
    """A model whose class has its own ``train_step`` (Keras's torch step, written out)."""

    def train_step(self, data):
        x, y = data
        y_pred = self(x, training=True)
        self.zero_grad()
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self._loss_tracker.update_state(loss, sample_weight=len(x))  # as Keras's own step does
        loss.backward()
        trainable = self.trainable_weights
        self.optimizer.apply([v.value.grad for v in trainable], trainable)
        return self.compute_metrics(x, y, y_pred)


def build(own_step: bool = False) -> keras.Model:
    set_random_seed(3)
    layers = [keras.layers.Dense(32, activation="relu"), keras.layers.Dense(16, activation="tanh"),
              keras.layers.Dense(3, activation="softmax")]
    if not own_step:
        return keras.Sequential([keras.Input((12,)), *layers])
    inputs = keras.Input((12,))
    out = inputs
    for layer in layers:
        out = layer(out)
    return OwnStep(inputs, out)


def data(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 12)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x, y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", default="cpu:0")
    p.add_argument("--ratios", default=None)
    p.add_argument("--min-devices", type=int, default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step waits while a lost rank has not come back (time for its restart)")
    p.add_argument("--input", choices=("arrays", "pydataset", "generator", "dataloader"), default="arrays",
                   help="how the training data comes: arrays, a PyDataset with two workers, a generator, or a "
                        "torch DataLoader with two workers")
    p.add_argument("--own-step", action="store_true", help="a model class with its own train_step")
    a = p.parse_args()
    model = build(a.own_step)
    if not a.plain:
        import multigpu

        ratios = a.ratios if a.ratios in (None, "auto") else [float(r) for r in a.ratios.split(",")]
        model = multigpu.parallelize(model, devices=a.devices.split(","), ratios=ratios,
                                     min_devices=a.min_devices, timeout=30)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    x, y = data(480, 0)
    vx, vy = data(96, 1)
    folder = os.path.dirname(os.path.abspath(a.out))
    checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(folder, "checkpoint.keras"))
    callbacks = [checkpoint]
    if a.step_sleep:
        import time

        def wait_for_return(batch, logs):
            state = multigpu.state(model)
            if len(state.lost) > len(state.joined):
                time.sleep(a.step_sleep)

        callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_end=wait_for_return))
    kwargs = {"batch_size": 48}
    if a.input == "pydataset":
        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return len(rows) // 48

            def __getitem__(self, i):
                return rows[i * 48 : (i + 1) * 48], labels[i * 48 : (i + 1) * 48]

        rows, labels = x, y
        x, y, kwargs = Batches(workers=2), None, {}
    elif a.input == "generator":
        def batches(rows, labels):
            while True:
                for i in range(0, len(rows), 48):
                    yield rows[i : i + 48], labels[i : i + 48]

        x, y, kwargs = batches(x, y), None, {"steps_per_epoch": len(x) // 48}
    elif a.input == "dataloader":
        import torch

        items = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        x, y, kwargs = torch.utils.data.DataLoader(items, batch_size=48, num_workers=2), None, {}
    hist = model.fit(x, y, epochs=a.epochs, shuffle=False, verbose=0, validation_data=(vx, vy),
                     callbacks=callbacks, **kwargs)
    lost, joined, rank = [], [], 0
    if not a.plain:
        state = multigpu.state(model)
        lost, joined, rank = state.lost, state.joined, state.rank
        print(f"rank {rank} shares {[round(r, 3) for r in state.ratios]} lost {[e['rank'] for e in lost]}",
              flush=True)
        if rank != min(set(range(state.world_size)) - {e["rank"] for e in lost}):
            return  # the writer: the lowest rank never lost
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    np.savez(a.out, history=json.dumps(hist.history), lost=json.dumps(lost), joined=json.dumps(joined),
             **arrays)


if __name__ == "__main__":
    main()
