"""TensorFlow-style training steps and optimizer features, compared with one plain process by the tests.

    KERAS_BACKEND=tensorflow python tensorflow_steps.py MODES OUT [--plain] [--devices ...] [--ratios ...]

MODES is a comma-separated list (or "all"); mode M writes OUT-M.npz (rank R > 0: OUT-M.npz.rankR.npz).

Modes:
  custom     a ``train_step`` of the model's own (``tf.GradientTape``, ``apply_gradients``, a metric), fit on
             97 rows at batch 32 (a ragged last step where one rank has no rows)
  gan        a GAN whose ``train_step`` calls two optimizers, trained by a ``train_on_batch`` loop
  features   one small model per optimizer feature: clipnorm, global_clipnorm, clipvalue, gradient
             accumulation, EMA, AdamW with a schedule, mixed_float16 (LossScaleOptimizer), mixed_bfloat16
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import modes
import numpy as np
import tensorflow as tf
from modes import parallel, save


def flat(model) -> np.ndarray:
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in model.get_weights()])


class Custom(keras.Model):
    """Keras's "customizing fit" guide's step on TensorFlow, with a metric of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.mae = keras.metrics.MeanAbsoluteError(name="mae")
        self.seen = keras.metrics.Sum(name="seen")

    def call(self, x):
        return self.out(self.hidden(x))

    @property
    def metrics(self):
        return [self.mae, self.seen]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = tf.reduce_mean(tf.square(y - y_pred))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.mae.update_state(y, y_pred)
        self.seen.update_state(tf.cast(tf.shape(x)[0], tf.float32))
        return {"mae": self.mae.result(), "seen": self.seen.result(), "loss": loss}


def custom(a):
    keras.utils.set_random_seed(3)
    model, rank = parallel(Custom(), a)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(97, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32) + 0.1).astype("float32")
    hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model.export(f"{a.out}.savedmodel", verbose=False)  # every rank calls it; rank 0 writes it
    save(a, rank, weights=flat(model), history=hist.history, probe=x[:5], pred=np.asarray(model(x[:5])))


class GAN(keras.Model):
    """Keras's conditional-GAN example in small: a discriminator step and a generator step, two optimizers."""

    def __init__(self, latent=3, **kwargs):
        super().__init__(**kwargs)
        self.latent = latent
        self.discriminator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                               keras.layers.Dense(1)])
        self.generator = keras.Sequential([keras.Input((latent,)), keras.layers.Dense(8, activation="relu"),
                                           keras.layers.Dense(4)])
        self.d_tracker = keras.metrics.Mean(name="d_loss")
        self.g_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_tracker, self.g_tracker]

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, x):
        return self.discriminator(x)

    def train_step(self, data):
        real, noise = data[0], data[1]  # the noise comes with the data: every device count draws the same
        batch = tf.shape(real)[0]
        generated = self.generator(noise)
        combined = tf.concat([generated, real], 0)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], 0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_tracker.update_state(d_loss)
        self.g_tracker.update_state(g_loss)
        return {"d_loss": self.d_tracker.result(), "g_loss": self.g_tracker.result()}


def gan(a):
    keras.utils.set_random_seed(11)
    model, rank = parallel(GAN(), a)
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05))
    rng = np.random.default_rng(2)
    real = rng.normal(1.0, 0.5, size=(60, 4)).astype("float32")
    noise = rng.normal(size=(60, 3)).astype("float32")
    logs = []
    for step in range(6):
        rows = slice((step % 3) * 20, (step % 3) * 20 + 20)
        logs.append(model.train_on_batch(real[rows], noise[rows], return_dict=True))
    save(a, rank, weights=flat(model), logs=[{k: float(v) for k, v in d.items()} for d in logs])


FEATURES = {
    "clipnorm": lambda: keras.optimizers.SGD(0.1, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.1, clipvalue=0.01),
    "accumulation": lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
    "ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3),
    "adamw_schedule": lambda: keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5),
                                                     weight_decay=0.1),
    "mixed_float16": lambda: keras.optimizers.SGD(0.1),
    "mixed_bfloat16": lambda: keras.optimizers.SGD(0.1),
}


def features(a):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(70, 5)).astype("float32")
    y = rng.integers(0, 3, size=(70,))
    out = {}
    rank = 0
    for name, optimizer in FEATURES.items():
        keras.config.set_dtype_policy(name if name.startswith("mixed") else "float32")
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax", dtype="float32")])
        model, rank = parallel(model, a)
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        hist = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        out[f"{name}.weights"] = flat(model)
        out[f"{name}.loss"] = np.asarray(hist.history["loss"])
        out[f"{name}.optimizer"] = [type(model.optimizer).__name__]
    keras.config.set_dtype_policy("float32")
    save(a, rank, **out)


MODES = {"custom": custom, "gan": gan, "features": features}


def main():
    modes.run(MODES, modes.parser().parse_args())


if __name__ == "__main__":
    main()
