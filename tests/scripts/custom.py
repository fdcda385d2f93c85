"""Custom training on a parallel model, compared with one plain process by the tests.

    python custom.py OUT.npz [--plain] [--devices cpu:0,cpu:1] [--ratios 3,1] [--modes gan,vae,...]

Every mode trains with SGD on fixed data (no shuffling, no random draws: the
noise a GAN or VAE needs comes with the data), so one device and N devices
compute the same thing.  Modes:

  gan          a train_step override with two optimizers and two backward passes (keras.io's DCGAN, small)
  vae          a built-in step with a KL ``add_loss`` term in a layer
  vae_step     a train_step override computing reconstruction + KL itself, with its own trackers
  distiller    a ``compute_loss`` override with a frozen teacher
  on_batch     a Keras-2 GAN loop: ``train_on_batch`` on a discriminator and a combined model sharing it
  unused       a model whose last layer never reaches the loss (only an internal ``add_loss``)
  frozen       a model with no trainable weights: fit, evaluate, predict; then one that freezes itself
  counts       callbacks of fit/evaluate/predict at batch_size=1 fire once per global batch
  scaled       a train_step override that halves its gradients in place between backward and apply
               (over gloo: the bucketed sums started during backward are stale, the step sums again)

In a parallel run a mode may also return ``overlap``: whether its last step
summed gradients during the backward pass (``multigpu.state(model).overlap``).
"""

import argparse
import json
import os
import sys
import warnings

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch
from keras import layers, ops
from seeding import set_random_seed

A = None  # the parsed arguments


def parallel(model, **kwargs):
    if A.plain:
        return model
    import multigpu

    ratios = [float(r) for r in A.ratios.split(",")] if A.ratios else None
    return multigpu.parallelize(model, devices=A.devices.split(","), ratios=ratios, timeout=30, **kwargs)


def rank() -> int:
    if A.plain:
        return 0
    import multigpu

    return multigpu.rank()


def flat(model) -> np.ndarray:
    return np.concatenate([np.ravel(w) for w in model.get_weights()]) if model.get_weights() else np.zeros(0)


def history(h) -> dict:
    return {k: [float(v) for v in vals] for k, vals in h.history.items()}


# ------------------------------------------------------------------ gan
class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def call(self, data):
        return self.discriminator(self.generator(data["z"]))

    def train_step(self, data):
        real, z = data["real"], data["z"]
        batch = real.shape[0]
        generated = self.generator(z)
        combined = torch.cat([generated, real], dim=0)
        labels = torch.cat([torch.ones((batch, 1)), torch.zeros((batch, 1))], dim=0)
        self.zero_grad()
        d_loss = self.loss_fn(labels, self.discriminator(combined))
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        self.zero_grad()
        g_loss = self.loss_fn(torch.zeros((batch, 1)), self.discriminator(self.generator(z)))
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss, sample_weight=batch)
        self.g_loss_tracker.update_state(g_loss, sample_weight=batch)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def gan_parts(latent=3):
    discriminator = keras.Sequential([keras.Input((6,)), layers.Dense(8, activation="tanh"), layers.Dense(1)],
                                     name="discriminator")
    generator = keras.Sequential([keras.Input((latent,)), layers.Dense(8, activation="tanh"), layers.Dense(6)],
                                 name="generator")
    return discriminator, generator


def gan():
    set_random_seed(10)
    d, g = gan_parts()
    model = parallel(GAN(d, g, 3))
    model.compile(keras.optimizers.SGD(0.05), keras.optimizers.SGD(0.05),
                  keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(10)
    data = {"real": rng.normal(size=(90, 6)).astype("float32"), "z": rng.normal(size=(90, 3)).astype("float32")}
    h = model.fit(data, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return {"weights": np.concatenate([flat(d), flat(g)]), "history": history(h), **overlap(model)}


def overlap(model) -> dict:
    if A.plain:
        return {}
    import multigpu

    return {"overlap": np.array(multigpu.state(model).overlap)}


# ------------------------------------------------------------------ scaled
class Scaled(keras.Sequential):
    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = self.compute_loss(x, y, self(x, training=True))
        loss.backward()
        for v in self.trainable_weights:
            v.value.grad.mul_(0.5)  # in place, after the backward pass wrote (and multigpu sent) them
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
        return {"loss": loss.detach()}


def scaled():
    set_random_seed(18)
    rng = np.random.default_rng(18)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 2))).astype("float32")
    model = parallel(Scaled([keras.Input((4,)), layers.Dense(5, activation="tanh"), layers.Dense(2)]))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return {"weights": flat(model), **overlap(model)}


# ------------------------------------------------------------------ vae
class Sampling(layers.Layer):
    """z = mean + exp(log_var / 2) * eps, with eps from the data; adds the KL term (a mean over rows)."""

    def call(self, inputs):
        mean, log_var, eps = inputs
        kl = -0.5 * ops.mean(ops.sum(1 + log_var - ops.square(mean) - ops.exp(log_var), axis=1))
        self.add_loss(0.1 * kl)
        return mean + ops.exp(0.5 * log_var) * eps


def vae_model():
    x_in, eps_in = keras.Input((8,), name="x"), keras.Input((2,), name="eps")
    h = layers.Dense(6, activation="relu")(x_in)
    mean, log_var = layers.Dense(2)(h), layers.Dense(2)(h)
    z = Sampling()([mean, log_var, eps_in])
    out = layers.Dense(8)(layers.Dense(6, activation="relu")(z))
    return keras.Model({"x": x_in, "eps": eps_in}, out)


def vae_data(rows=75):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(rows, 8)).astype("float32")
    return {"x": x, "eps": rng.normal(size=(rows, 2)).astype("float32")}, x


def vae():
    set_random_seed(11)
    model = parallel(vae_model())
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = vae_data()
    h = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    return {"weights": flat(model), "history": history(h)}


class VAEStep(keras.Model):
    """keras.io's VAE pattern: the step computes reconstruction + KL itself, with its own trackers."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.total = keras.metrics.Mean(name="total_loss")
        self.recon = keras.metrics.Mean(name="reconstruction_loss")

    @property
    def metrics(self):
        return [self.total, self.recon]

    def call(self, x):
        return self.inner(x)

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        pred = self.inner(x, training=True)
        recon = ops.mean(ops.square(pred - y))
        total = recon + ops.sum(self.inner.losses)
        total.backward()
        trainable = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in trainable], trainable)
        rows = x["x"].shape[0]
        self.total.update_state(total, sample_weight=rows)
        self.recon.update_state(recon, sample_weight=rows)
        return {"total_loss": self.total.result(), "reconstruction_loss": self.recon.result(),
                "kl": ops.sum(self.inner.losses)}


def vae_step():
    set_random_seed(12)
    model = parallel(VAEStep(vae_model()))
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = vae_data()
    h = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    return {"weights": flat(model), "history": history(h)}


# ------------------------------------------------------------------ distiller
class Distiller(keras.Model):
    """Keras 3's distillation example: a ``compute_loss`` override and a frozen teacher."""

    def __init__(self, student, teacher):
        super().__init__()
        self.student, self.teacher = student, teacher

    def compile(self, optimizer, metrics, alpha=0.3, temperature=2.0):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.alpha, self.temperature = alpha, temperature
        self.student_loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.distillation_loss_fn = keras.losses.KLDivergence()

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False, training=True):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        t = self.temperature
        distill = self.distillation_loss_fn(ops.softmax(teacher_pred / t, axis=1),
                                            ops.softmax(y_pred / t, axis=1)) * t**2
        return self.alpha * student_loss + (1 - self.alpha) * distill

    def call(self, x):
        return self.student(x)


def distiller():
    set_random_seed(13)
    teacher = keras.Sequential([keras.Input((5,)), layers.Dense(12, activation="relu"), layers.Dense(3)])
    student = keras.Sequential([keras.Input((5,)), layers.Dense(4, activation="relu"), layers.Dense(3)])
    teacher.trainable = False
    model = parallel(Distiller(student, teacher))
    model.compile(keras.optimizers.SGD(0.1), metrics=[keras.metrics.SparseCategoricalAccuracy()])
    rng = np.random.default_rng(13)
    x = rng.normal(size=(83, 5)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")
    before = flat(teacher)
    h = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert np.array_equal(before, flat(teacher)), "the frozen teacher changed"
    return {"weights": flat(student), "history": history(h)}


# ------------------------------------------------------------------ train_on_batch GAN
def on_batch():
    set_random_seed(14)
    d, g = gan_parts()
    d = parallel(d)
    d.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    d.trainable = False
    combined = parallel(keras.Sequential([g, d]))
    combined.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(14)
    real = rng.normal(size=(96, 6)).astype("float32")
    z = rng.normal(size=(96, 3)).astype("float32")
    logs = []
    for i in range(0, 96, 24):
        fake = g.predict_on_batch(z[i : i + 24])
        d.trainable = True
        d_loss = d.train_on_batch(np.concatenate([fake, real[i : i + 24]]),
                                  np.concatenate([np.ones((24, 1)), np.zeros((24, 1))]).astype("float32"))
        d.trainable = False
        g_loss = combined.train_on_batch(z[i : i + 24], np.zeros((24, 1), "float32"))
        logs.append([float(d_loss), float(g_loss)])
    test = combined.test_on_batch(z[:30], np.zeros((30, 1), "float32"))
    pred = combined.predict_on_batch(z[:30])
    return {"weights": np.concatenate([flat(d), flat(g)]), "history": {"logs": logs, "test": [float(test)]},
            "pred": np.asarray(pred)}


# ------------------------------------------------------------------ unused parameters
class InternalLoss(layers.Layer):
    def call(self, x):
        self.add_loss(ops.mean(ops.sum(x * x, axis=1)))
        return x


def unused():
    set_random_seed(15)
    model = parallel(keras.Sequential([keras.Input((2,)), layers.Dense(2), InternalLoss(), layers.Dense(1)]))
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    last = flat(keras.Sequential(model.layers[-1:]))
    h = model.fit(np.ones((16, 2), "float32") * np.arange(16)[:, None] / 16, np.zeros((16, 1), "float32"),
                  batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert np.array_equal(last, flat(keras.Sequential(model.layers[-1:]))), "the unused layer changed"
    return {"weights": flat(model), "history": history(h)}


# ------------------------------------------------------------------ frozen models
class Freeze(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.model.trainable = False


def frozen():
    set_random_seed(16)
    x = np.random.default_rng(16).normal(size=(40, 3)).astype("float32")
    y = x[:, :1] * 2
    model = parallel(keras.Sequential([keras.Input((3,)), layers.Dense(1, trainable=False)]))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    said = any("does not have any trainable weights" in str(w.message) for w in caught)
    ev = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    pred = model.predict(x[:10], batch_size=4, verbose=0)
    # A model that freezes itself after its first epoch.
    second = parallel(keras.Sequential([keras.Input((3,)), layers.Dense(4, activation="relu"), layers.Dense(1)]))
    second.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    h2 = second.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[Freeze()])
    return {"weights": np.concatenate([flat(model), flat(second)]), "pred": pred,
            "history": {**history(h), "evaluate": [ev["loss"], ev["mae"]], "second": history(h2)["loss"],
                        "warned": [float(said)]}}


# ------------------------------------------------------------------ callback counts
class Counter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.counts = {"train": 0, "test": 0, "predict": 0}
        self.indexes = {"train": [], "test": [], "predict": []}

    def on_train_batch_end(self, batch, logs=None):
        self.counts["train"] += 1
        self.indexes["train"].append(batch)

    def on_test_batch_end(self, batch, logs=None):
        self.counts["test"] += 1
        self.indexes["test"].append(batch)

    def on_predict_batch_end(self, batch, logs=None):
        self.counts["predict"] += 1
        self.indexes["predict"].append(batch)


def counts():
    set_random_seed(17)
    model = parallel(keras.Sequential([keras.Input((3,)), layers.Dense(3)]))
    model.compile(optimizer="sgd", loss="mse", metrics=["mse"])
    cb = Counter()
    model.fit(np.ones((4, 3)), np.ones((4, 3)), callbacks=[cb], epochs=3, batch_size=1, verbose=0,
              validation_data=(np.ones((2, 3)), np.ones((2, 3))))
    model.evaluate(np.ones((5, 3)), np.ones((5, 3)), batch_size=1, callbacks=[cb], verbose=0)
    out = model.predict(np.ones((4, 3)), batch_size=1, callbacks=[cb], verbose=0)
    return {"weights": flat(model), "pred": out,
            "history": {"counts": [cb.counts["train"], cb.counts["test"], cb.counts["predict"]],
                        "predict_indexes": cb.indexes["predict"]}}


MODES = {"gan": gan, "vae": vae, "vae_step": vae_step, "distiller": distiller, "on_batch": on_batch,
         "unused": unused, "frozen": frozen, "counts": counts, "scaled": scaled}


def main():
    global A
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--devices", default="cpu:0,cpu:1")
    p.add_argument("--ratios", default="3,1")
    p.add_argument("--modes", default=",".join(MODES))
    A = p.parse_args()
    results = {}
    for mode in A.modes.split(","):
        results[mode] = MODES[mode]()
    arrays = {}
    for mode, res in results.items():
        for key, value in res.items():
            arrays[f"{mode}.{key}"] = json.dumps(value) if key == "history" else value
    path = A.out if rank() == 0 else f"{A.out}.rank{rank()}.npz"
    np.savez(path, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
