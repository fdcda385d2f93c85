"""A model with its own ``train_step`` (keras.io's "customizing fit()" guides, one per backend) on a device that
runs out of memory: automatic shares, and the step taken again.

    MULTIGPU_FAULT=0:forward/oom:5 python custom_oom.py DEVICES OUT

The last rank trains one device on the same batches and writes the largest difference of the weights,
relative to their scale, to OUT.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed

import multigpu

BACKEND = keras.backend.backend()
devices, out = sys.argv[1].split(","), sys.argv[2]


class OwnStep(keras.Model):
    """A ``train_step`` of the model's own: the loss, its gradients and the optimizer's update, as each backend's
    guide writes them; the compiled loss tracker gives the logs."""

    def train_step(self, *args):
        if BACKEND == "jax":
            return self._jax_step(*args)
        x, y = args[0]
        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
        else:
            self.zero_grad()
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
        self.optimizer.apply(grads, self.trainable_weights)
        return self.compute_metrics(x, y, None)

    def _jax_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_of(trainable, non_trainable):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
            loss, (_, non_trainable, _) = self.stateless_compute_loss(
                trainable, non_trainable, metrics_variables, x=x, y=y, y_pred=y_pred)
            return loss, non_trainable

        (_, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable, non_trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)


def build():
    set_random_seed(0)
    inputs = keras.Input((32,))
    outputs = keras.layers.Dense(10)(keras.layers.Dense(256, activation="tanh")(inputs))
    model = OwnStep(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


rng = np.random.default_rng(0)
x = rng.standard_normal((2048, 32)).astype(np.float32)
y = rng.integers(0, 10, 2048)
model = build()
initial = [np.random.default_rng(1).standard_normal(w.shape).astype(np.float32) * 0.05 for w in model.get_weights()]
model.set_weights(initial)
model = multigpu.parallelize(model, devices=devices, ratios="auto", shard_optimizer=False)
model.fit(x, y, batch_size=256, epochs=2, shuffle=False, verbose=0)
if multigpu.rank() == multigpu.world_size() - 1:
    reference = build()
    reference.set_weights(initial)
    reference.fit(x, y, batch_size=256, epochs=2, shuffle=False, verbose=0)
    error = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
                for a, b in zip(model.get_weights(), reference.get_weights()))
    with open(out, "w") as f:
        json.dump({"error": error}, f)
