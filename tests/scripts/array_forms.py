"""Training on the array forms Keras takes besides NumPy, compared with one plain process by the tests.

    python array_forms.py OUT.npz --plain       # one device, plain Keras, NumPy arrays
    multigpu run --devices cpu:0,cpu:1 --ratios 3,1 array_forms.py OUT.npz

The parallel run fits on the backend's own arrays where it has them
(``jax.Array`` on JAX, ``tf.Tensor`` on TensorFlow) and on a pandas DataFrame
and Series on torch, validates on pandas, evaluates on ``jax.Array``s and
predicts on a TensorFlow tensor.
Writes the weights, History, evaluation and predictions (rank R > 0:
OUT.rankR.npz).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(90, 4)).astype("float32")
    y = (x[:, 0] - x[:, 2] > 0).astype("int64")
    set_random_seed(4)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    rank = 0
    fit_x, fit_y, val, eval_xy, pred_x = x[:70], y[:70], (x[70:], y[70:]), (x, y), x
    if not a.plain:
        import jax.numpy as jnp
        import pandas as pd
        import tensorflow as tf

        import multigpu

        model = multigpu.parallelize(model, timeout=60)
        rank = multigpu.rank()
        frame = pd.DataFrame(x, columns=list("abcd"))
        own = {"jax": jnp.asarray, "tensorflow": tf.constant}.get(keras.backend.backend())
        fit_x, fit_y = (own(x[:70]), own(y[:70])) if own else (frame.iloc[:70], pd.Series(y[:70]))
        val = (frame.iloc[70:], pd.Series(y[70:]))
        eval_xy = (jnp.asarray(x), jnp.asarray(y))
        pred_x = tf.constant(x)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(fit_x, fit_y, batch_size=16, epochs=2, validation_data=val, shuffle=False, verbose=0)
    evaluation = model.evaluate(*eval_xy, batch_size=32, verbose=0, return_dict=True)
    np.savez(a.out if rank == 0 else f"{a.out}.rank{rank}.npz",
             weights=np.concatenate([w.ravel() for w in model.get_weights()]), history=json.dumps(history.history),
             evaluate=json.dumps({k: float(v) for k, v in evaluation.items()}),
             predict=model.predict(pred_x, batch_size=32, verbose=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
