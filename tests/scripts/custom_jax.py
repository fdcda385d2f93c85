"""A model with its own JAX ``train_step`` and ``test_step`` (keras.io's "customizing fit() with JAX"
guide), trained with SGD and Adam, then evaluated; writes the final weights, History and evaluate's
results to an .npz file.

    KERAS_BACKEND=jax python custom_jax.py OUT.npz --plain          # no multigpu
    KERAS_BACKEND=jax multigpu run --devices cpu:0,cpu:1 --ratios 3,1 custom_jax.py OUT.npz

With ``--sync-bn`` the model has a BatchNormalization layer and runs with ``sync_batchnorm=True``.
"""

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras
import numpy as np
from seeding import set_random_seed


class Guide(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable, non_trainable, x, y, training=False):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=training)
        return self.loss_fn(y, y_pred), (y_pred, non_trainable)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y, training=True)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        n = len(self.loss_tracker.variables)
        tracker = self.loss_tracker.stateless_update_state(metrics_variables[:n], loss, sample_weight=x.shape[0])
        mae = self.mae_metric.stateless_update_state(metrics_variables[n:], y, y_pred)
        logs = {"loss": self.loss_tracker.stateless_result(tracker), "mae": self.mae_metric.stateless_result(mae),
                "scale": 2.0}
        return logs, (trainable, non_trainable, optimizer_variables, tracker + mae)

    def test_step(self, state, data):
        trainable, non_trainable, metrics_variables = state
        x, y = data
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=False)
        loss = self.loss_fn(y, y_pred)
        n = len(self.loss_tracker.variables)
        tracker = self.loss_tracker.stateless_update_state(metrics_variables[:n], loss, sample_weight=x.shape[0])
        mae = self.mae_metric.stateless_update_state(metrics_variables[n:], y, y_pred)
        logs = {"loss": self.loss_tracker.stateless_result(tracker), "mae": self.mae_metric.stateless_result(mae),
                "rows": float(x.shape[0])}
        return logs, (trainable, non_trainable, tracker + mae)

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--rows", type=int, default=193)
    p.add_argument("--batch", type=int, default=64, help="global batch of fit and evaluate")
    p.add_argument("--sync-bn", action="store_true", help="a BatchNormalization layer, sync_batchnorm=True")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(a.rows, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 2))).astype("float32")
    arrays, rank = {}, 0
    for name in ("sgd", "adam"):
        set_random_seed(1)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="tanh")(inputs)
        if a.sync_bn:
            hidden = keras.layers.BatchNormalization()(hidden)
        model = Guide(inputs, keras.layers.Dense(2)(hidden))
        if not a.plain:
            import multigpu

            model = multigpu.parallelize(model, sync_batchnorm=a.sync_bn)
            rank = multigpu.rank()
        model.compile(optimizer=keras.optimizers.SGD(0.05) if name == "sgd" else keras.optimizers.Adam(0.01))
        hist = model.fit(x, y, batch_size=a.batch, epochs=2, shuffle=False, verbose=0)
        evaluation = model.evaluate(x, y, batch_size=a.batch, verbose=0, return_dict=True)
        arrays[f"{name}.evaluate"] = json.dumps({k: float(v) for k, v in evaluation.items()})  # Keras 3.10: arrays
        for i, w in enumerate(model.get_weights()):
            arrays[f"{name}.w{i}"] = w
        arrays[f"{name}.history"] = json.dumps(hist.history)
    np.savez(a.out if rank == 0 else f"{a.out}.rank{rank}.npz", **arrays)


if __name__ == "__main__":
    main()
