"""A sharded optimizer (``shard_optimizer=True``) against one plain process, on torch and TensorFlow
(``KERAS_BACKEND``).

    python sharded.py MODES OUT [--plain] [--devices cpu:0,cpu:1] [--ratios 3,1] [--shard optimizer|gradients|weights]

MODES is a comma-separated list (or "all"); mode M writes OUT-M.npz (rank R > 0: OUT-M.npz.rankR.npz).

Modes:
  features   one small model per optimizer feature, fit one epoch on 70 rows
             at batch 16 (five steps, a ragged last one): Adam, SGD with momentum, RMSprop, clipnorm,
             global_clipnorm, clipvalue, gradient accumulation, EMA, AdamW with a schedule, mixed_float16
             (LossScaleOptimizer), mixed_bfloat16;
             each writes its weights, losses, how many optimizer-state values this rank held after
             training, how many gradient values its variables kept (torch), and the whole optimizer state
             after ``multigpu.unparallelize``
  custom     a ``train_step`` of the model's own (backward, ``optimizer.apply``) with Adam
  gan        a GAN whose ``train_step`` calls two optimizers (Adam, SGD with momentum), by ``train_on_batch``
  default    no ``shard_optimizer`` given (equal shares): whether the run holds the state in parts (it does where
             the ranks sum through shared memory), with Adam, then with SGD, which keeps no state to put in parts
  checkpoint one epoch of Adam with a ``ModelCheckpoint`` (``.weights.h5``), then ``model.save`` (a
             ``.keras`` file); the parallel run then trains another epoch, loads the ``.weights.h5`` into
             its sharded optimizer and trains the second epoch again; the plain run trains two epochs,
             and also loads the ``.keras`` file in this plain process and trains its second epoch
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import modes
import numpy as np
from modes import save
from seeding import set_random_seed


def parallel(model, a):
    return modes.parallel(model, a, shard=a.shard)


def gradients_kept(model) -> int:
    """Gradient values the model's variables hold after training (torch: ``.grad``; -1 elsewhere)."""
    if keras.backend.backend() != "torch":
        return -1
    return int(sum(v.value.grad.numel() for v in model.trainable_variables if v.value.grad is not None))


def flat(values) -> np.ndarray:
    return np.concatenate([np.asarray(keras.ops.convert_to_numpy(w), np.float64).ravel() for w in values])


def held(optimizer) -> int:
    """Optimizer-state values this process holds in memory (a sharded rank: its part and the scalars)."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    return int(sum(np.prod(v.value.shape) for v in inner.variables))


def gradients(model, loss_fn, variables):
    """``(loss, gradients of variables)``: by ``backward`` on torch, a ``GradientTape`` on TensorFlow."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn()
        return loss, tape.gradient(loss, variables)
    model.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss, [v.value.grad for v in variables]


def apply(optimizer, grads, variables):
    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            optimizer.apply(grads, variables)
    else:
        optimizer.apply(grads, variables)


FEATURES = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "clipnorm": lambda: keras.optimizers.SGD(0.1, momentum=0.5, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.1, momentum=0.5, clipvalue=0.01),
    "accumulation": lambda: keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2),
    "ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3),
    "adamw_schedule": lambda: keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5),
                                                     weight_decay=0.1),
    "mixed_float16": lambda: keras.optimizers.Adam(0.01),
    "mixed_bfloat16": lambda: keras.optimizers.Adam(0.01),
}


def small_model():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"),
                             keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(3, activation="softmax", dtype="float32")])


def features(a):
    import multigpu

    rng = np.random.default_rng(4)
    x = rng.normal(size=(70, 5)).astype("float32")
    y = rng.integers(0, 3, size=(70,))
    out = {}
    rank = 0
    for name, optimizer in FEATURES.items():
        keras.config.set_dtype_policy(name if name.startswith("mixed") else "float32")
        set_random_seed(5)
        model, rank = parallel(small_model(), a)
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy")
        if name == "ema" and (keras.backend.backend() == "jax" or a.shard == "weights") and not a.plain:
            try:  # refused on JAX and with the weights in parts, on every rank, before any step
                model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
            except ValueError as exc:
                out["ema.refused"] = [str(exc)]
            multigpu.unparallelize(model)
            continue
        hist = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        out[f"{name}.weights"] = flat(model.get_weights())
        out[f"{name}.loss"] = np.asarray(hist.history["loss"])
        out[f"{name}.held"] = np.asarray(held(model.optimizer))
        out[f"{name}.gradients_kept"] = np.asarray(gradients_kept(model))
        out[f"{name}.optimizer"] = [type(model.optimizer).__name__]
        if not a.plain:
            multigpu.unparallelize(model)
        out[f"{name}.state"] = flat(model.optimizer.variables)
    keras.config.set_dtype_policy("float32")
    save(a, rank, **out)


class Custom(keras.Model):
    """Keras's "customizing fit" step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        trainable = self.trainable_weights
        loss, grads = gradients(self, lambda: keras.ops.mean(keras.ops.square(self(x, training=True) - y)),
                                trainable)
        apply(self.optimizer, grads, trainable)
        return {"loss": loss}


class StatelessCustom(Custom):
    """The same step in JAX's stateless style (Keras's "customizing fit with JAX")."""

    def train_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)

        def loss_fn(trainable):
            y_pred, updated = self.stateless_call(trainable, non_trainable, x)
            return keras.ops.mean(keras.ops.square(y_pred - y)), updated

        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


def custom(a):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    set_random_seed(3)
    model = StatelessCustom() if keras.backend.backend() == "jax" else Custom()
    model(x[:1])  # built, with its weights
    model, rank = parallel(model, a)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    save(a, rank, weights=flat(model.get_weights()), held=np.asarray(held(model.optimizer)))


class GAN(keras.Model):
    """Two optimizers, two backward passes (the noise comes with the data: no random draws)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                                           keras.layers.Dense(4)])
        self.discriminator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                               keras.layers.Dense(1)])

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def call(self, x):
        return self.discriminator(self.generator(x))

    def train_step(self, data):
        real, noise, _ = keras.utils.unpack_x_y_sample_weight(data)
        bce = keras.losses.BinaryCrossentropy(from_logits=True)

        def d_loss():
            fake = self.generator(noise)
            return (bce(keras.ops.ones((keras.ops.shape(real)[0], 1)), self.discriminator(real))
                    + bce(keras.ops.zeros((keras.ops.shape(fake)[0], 1)), self.discriminator(fake)))

        d_vars = self.discriminator.trainable_weights
        loss_d, grads = gradients(self, d_loss, d_vars)
        apply(self.d_optimizer, grads, d_vars)
        g_vars = self.generator.trainable_weights
        ones = keras.ops.ones((keras.ops.shape(noise)[0], 1))
        loss_g, grads = gradients(self, lambda: bce(ones, self.discriminator(self.generator(noise))), g_vars)
        apply(self.g_optimizer, grads, g_vars)
        return {"d_loss": loss_d, "g_loss": loss_g}


def gan(a):
    set_random_seed(11)
    model = GAN()
    model.build((None, 3))
    model, rank = parallel(model, a)
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05, momentum=0.9))
    rng = np.random.default_rng(2)
    real = rng.normal(1.0, 0.5, size=(60, 4)).astype("float32")
    noise = rng.normal(size=(60, 3)).astype("float32")
    logs = []
    for step in range(6):
        rows = slice((step % 3) * 20, (step % 3) * 20 + 20)
        logs.append(model.train_on_batch(real[rows], noise[rows], return_dict=True))
    save(a, rank, weights=flat(model.get_weights()), logs=[{k: float(v) for k, v in d.items()} for d in logs],
         held=np.asarray(held(model.d_optimizer) + held(model.g_optimizer)))


def checkpoint(a):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(96, 5)).astype("float32")
    y = rng.integers(0, 3, size=(96,))
    folder = os.path.dirname(os.path.abspath(a.out))
    path, weights = os.path.join(folder, "sharded-epoch1.keras"), os.path.join(folder, "sharded-epoch1.weights.h5")

    def compiled():
        set_random_seed(5)
        model, rank = parallel(small_model(), a)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        return model, rank

    model, rank = compiled()
    if not a.plain:
        saver = keras.callbacks.ModelCheckpoint(weights, save_weights_only=True)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[saver])
        model.save(path)
        after_one = flat(model.get_weights())
        # one more epoch moves the weights and the sharded state on; loading the ModelCheckpoint's file (the
        # whole state, read into the parts) takes them back to epoch 1, and the second epoch is trained again
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        model.load_weights(weights)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        save(a, rank, weights=after_one, loaded=flat(model.get_weights()))
        return
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    resumed = keras.saving.load_model(path)
    resumed.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    save(a, rank, weights=flat(model.get_weights()), resumed=flat(resumed.get_weights()),
         state=flat(model.optimizer.variables), resumed_state=flat(resumed.optimizer.variables))


def default(a):
    """No ``shard_optimizer`` given: what the run chose, and the state each rank held."""
    import multigpu

    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.integers(0, 3, size=(64,))
    set_random_seed(5)
    model = small_model()
    if not a.plain:
        model = multigpu.parallelize(model, devices=a.devices.split(","), ratios=[1.0] * len(a.devices.split(",")),
                                     timeout=60)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    sharded = bool(multigpu.state(model).shard_optimizer) if not a.plain else False
    level = str(multigpu.state(model).shard) if not a.plain else "None"
    set_random_seed(6)
    stateless = small_model()  # SGD: nothing per weight to hold in parts
    if not a.plain:
        stateless = multigpu.parallelize(stateless, devices=a.devices.split(","),
                                         ratios=[1.0] * len(a.devices.split(",")), timeout=60)
    stateless.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    stateless.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    sgd_level = str(multigpu.state(stateless).shard) if not a.plain else "None"
    save(a, 0 if a.plain else multigpu.rank(), sharded=np.asarray(sharded), held=np.asarray(held(model.optimizer)),
         level=np.asarray(level), gradients_kept=np.asarray(gradients_kept(model)), sgd_level=np.asarray(sgd_level),
         sgd_weights=flat(stateless.get_weights()))


MODES = {"default": default, "features": features, "custom": custom, "gan": gan, "checkpoint": checkpoint}


def main():
    p = modes.parser()
    p.add_argument("--shard", default="optimizer", choices=["optimizer", "gradients", "weights"])
    modes.run(MODES, p.parse_args())


if __name__ == "__main__":
    main()
