"""Keras features on a parallel model, compared with one plain process by the tests.

    python keras_features.py MODES OUT [--plain] [--devices ...] [--ratios ...]

MODES is a comma-separated list (or "all"); mode M writes OUT-M.npz (rank R > 0: OUT-M.npz.rankR.npz).

Modes:
  two_input   two inputs, BatchNorm, Dropout; class_weight, validation_split,
              ModelCheckpoint(save_best_only), EarlyStopping, CSVLogger
  two_output  two outputs, per-output losses/metrics, sample_weight; then
              evaluate and predict (with --steps-per-execution N: N batches a call)
  sync_bn     BatchNorm model, sync_batchnorm=True (exact against one device)
  shared_bn   one BatchNorm layer applied in two parallel branches, sync_batchnorm=True
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import modes
import numpy as np
from modes import save
from seeding import set_random_seed


def parallel(model, a, **kwargs):
    return modes.parallel(model, a, timeout=30, **kwargs)


def two_input(a):
    set_random_seed(3)
    i1, i2 = keras.Input((6,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Concatenate()([i1, i2])
    h = keras.layers.Dense(16, activation="relu")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.3)(h)
    out = keras.layers.Dense(3, activation="softmax")(h)
    model, rank = parallel(keras.Model([i1, i2], out), a)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(1)
    x = {"a": rng.normal(size=(300, 6)).astype("float32"), "b": rng.normal(size=(300, 3)).astype("float32")}
    y = (x["a"][:, 0] > 0).astype("int64") + (x["b"][:, 0] > 1).astype("int64")
    ckpt = os.path.join(os.path.dirname(os.path.abspath(a.out)), "best.keras")
    callbacks = [
        keras.callbacks.ModelCheckpoint(ckpt, monitor="val_loss", save_best_only=True),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
        keras.callbacks.CSVLogger(os.path.join(os.path.dirname(os.path.abspath(a.out)), "log.csv")),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5),
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.95),
    ]
    hist = model.fit(x, y, batch_size=32, epochs=8, validation_split=0.2, class_weight={0: 1.0, 1: 2.0, 2: 3.0},
                     callbacks=callbacks, verbose=0)
    # fit returns once every rank has run its callbacks' end hooks: rank 0's CSV log is complete for rank 1.
    with open(os.path.join(os.path.dirname(os.path.abspath(a.out)), "log.csv")) as f:
        csv_rows = len(f.read().strip().splitlines())
    # A save that Keras refuses (on rank 0, the rank that writes) raises the same error on every rank.
    try:
        model.save(os.path.join(os.path.dirname(os.path.abspath(a.out)), "model.notkeras"))
        save_error = ""
    except ValueError as exc:
        save_error = str(exc)
    # keras.saving.save_model writes once too (rank 0, atomically), and every rank can load the file at once.
    api_path = os.path.join(os.path.dirname(os.path.abspath(a.out)), "api.keras")
    keras.saving.save_model(model, api_path)
    api_loaded = all(np.array_equal(u, v) for u, v in zip(keras.saving.load_model(api_path).get_weights(),
                                                           model.get_weights(), strict=True))
    model.summary()
    probe = {"a": np.ones((4, 6), "float32"), "b": np.ones((4, 3), "float32")}
    pred = model.predict(probe, verbose=0)
    # Dropout must draw different numbers on each rank.
    dropout = next(layer for layer in model.layers if isinstance(layer, keras.layers.Dropout))
    mask = keras.ops.convert_to_numpy(dropout(keras.ops.ones((64, 16)), training=True))
    lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    save(a, rank, pred=pred, mask=mask, history=hist.history, lr=np.array(lr), probe_a=probe["a"], probe_b=probe["b"],
         csv_rows=np.array(csv_rows), save_error=[save_error], api_loaded=np.array(api_loaded),
         weights_moving=np.concatenate([w.ravel() for w in model.get_weights()]))


def two_output(a):
    set_random_seed(4)
    inp = keras.Input((5,))
    h = keras.layers.Dense(12, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-3))(inp)
    out1 = keras.layers.Dense(1, name="reg")(h)
    out2 = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    model, rank = parallel(keras.Model(inp, [out1, out2]), a)
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=["mse", "sparse_categorical_crossentropy"],
                  loss_weights=[0.5, 1.0],
                  metrics=[["mae"], ["accuracy"]], steps_per_execution=a.steps_per_execution)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(170, 5)).astype("float32")
    y = [x[:, :1] * 2.0, (x[:, 1] > 0).astype("int64")]
    sw = rng.uniform(0.5, 2.0, size=(170,)).astype("float32")
    hist = model.fit(x, y, sample_weight=sw, batch_size=40, epochs=3, shuffle=False, verbose=0)
    ev = model.evaluate(x, y, sample_weight=sw, batch_size=48, return_dict=True, verbose=0)
    pred = model.predict(x, batch_size=48, verbose=0)
    save(a, rank, history=hist.history, evaluate=ev, pred_reg=pred[0], pred_cls=pred[1],
         weights=np.concatenate([w.ravel() for w in model.get_weights()]))


def sync_bn(a):
    set_random_seed(5)
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3),
        keras.layers.BatchNormalization(),
        keras.layers.Activation("relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(8),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(2, activation="softmax"),
    ])
    model, rank = parallel(model, a, **({} if a.plain else {"sync_batchnorm": True}))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(97, 6, 6, 2)).astype("float32")
    y = (x[:, 0, 0, 0] > 0).astype("int64")
    hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    save(a, rank, history=hist.history, weights=np.concatenate([w.ravel() for w in model.get_weights()]))


def shared_bn(a):
    set_random_seed(7)
    i1, i2 = keras.Input((5,)), keras.Input((5,))
    bn, dense = keras.layers.BatchNormalization(), keras.layers.Dense(5)
    h = keras.layers.Concatenate()([bn(dense(i1)), bn(dense(i2))])
    model, rank = parallel(keras.Model([i1, i2], keras.layers.Dense(1)(h)), a,
                           **({} if a.plain else {"sync_batchnorm": True}))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(0)
    x1, x2 = rng.normal(size=(97, 5)).astype("float32"), (rng.normal(size=(97, 5)) * 3 + 1).astype("float32")
    y = (x1.sum(1) - x2[:, 0]).reshape(-1, 1).astype("float32")
    hist = model.fit([x1, x2], y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    save(a, rank, history=hist.history, weights=np.concatenate([w.ravel() for w in model.get_weights()]))


MODES = {"two_input": two_input, "two_output": two_output, "sync_bn": sync_bn, "shared_bn": shared_bn}


def main():
    p = modes.parser()
    p.add_argument("--steps-per-execution", type=int, default=1, help="two_output's (the same numbers as 1)")
    p.add_argument("--eager", action="store_true", help="TensorFlow: a plain reference run eagerly (Keras's "
                   "traced step weighs each output's loss by a batch size it may not know)")
    a = p.parse_args()
    if a.eager:
        import tensorflow as tf

        tf.config.run_functions_eagerly(True)
    modes.run(MODES, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
