"""Training fed by tf.data pipelines and Keras's own dataset utilities, compared with one plain process.

    python tfdata.py OUT.npz --plain          # one device, plain Keras
    multigpu run --devices cpu:0,cpu:1 --ratios 3,1 tfdata.py OUT.npz
    multigpu run --devices cpu:0,cpu:1 tfdata.py OUT.npz --fail       # a map function that raises

Three models, each from one input form:

* ``map``: ``from_tensor_slices`` + a seeded ``shuffle`` reshuffled each epoch + ``map`` with
  ``num_parallel_calls`` + ``batch`` (90 rows at 32: a ragged last batch) + ``prefetch``, 2 epochs,
  with a ``tf.data`` validation set;
* ``repeat``: the same pipeline at batch 8, ``repeat()``-ed, 3 epochs of ``steps_per_epoch=5``
  (one iterator across epochs, as in Keras, crossing into the second repetition);
* ``images`` and ``images_grain``: ``keras.utils.image_dataset_from_directory`` over PNG files the
  script writes, with ``validation_split``/``subset="both"`` and a seeded shuffle, in both of its
  formats (``"tf"`` and ``"grain"``);
* ``text``: ``keras.utils.text_dataset_from_directory`` over text files the script writes, with a
  validation split, made numbers by a ``TextVectorization`` layer in ``dataset.map``;
* ``timeseries``: ``keras.utils.timeseries_dataset_from_array`` with a seeded shuffle;
* ``audio``: ``keras.utils.audio_dataset_from_directory`` over WAV files the script writes, cut to a fixed
  length, with a validation split and a seeded shuffle.

Then ``evaluate`` and ``predict`` on datasets.  Writes every model's weights and History, the
evaluation and the predictions (rank R > 0: OUT.rankR.npz).
"""

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import tensorflow as tf

ROWS, BATCH = 90, 32
KINDS = ("map", "repeat", "text", "timeseries", "audio", "images", "images_grain")


def make_data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64")
    return x, y


def pipeline(x, y, *, fail: bool = False, batch: int = BATCH):
    def scale(features, label):
        return features * 2.0 + 0.5, label

    def broken(features, label):
        def boom(v):
            raise OSError("cannot decode row")
        return tf.py_function(boom, [features], tf.float32), label

    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=3, reshuffle_each_iteration=True)
    ds = ds.map(broken if fail else scale, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch).prefetch(tf.data.AUTOTUNE)


def write_images(folder: str) -> None:
    rng = np.random.default_rng(7)
    os.makedirs(folder)
    for label in ("a", "b"):
        os.makedirs(os.path.join(folder, label))
        for i in range(24):
            base = 40 if label == "a" else 200
            pixels = np.clip(base + rng.normal(0, 30, size=(8, 8, 3)), 0, 255).astype("uint8")
            keras.utils.save_img(os.path.join(folder, label, f"{i:03d}.png"), pixels)


def write_texts(folder: str) -> None:
    rng = np.random.default_rng(9)
    words = {"pos": ["good", "great", "fine"], "neg": ["bad", "awful", "poor"]}
    for label, own in words.items():
        os.makedirs(os.path.join(folder, label))
        for i in range(20):
            text = " ".join(rng.choice([*own, "the", "film", "was", "a"], size=int(rng.integers(3, 9))))
            with open(os.path.join(folder, label, f"{i:03d}.txt"), "w") as f:
                f.write(text)


def write_audio(folder: str) -> None:
    """Mono 16-bit WAV clips of 40 to 60 samples: a low tone for one class, a high one for the other."""
    import wave

    rng = np.random.default_rng(11)
    for label, pitch in (("low", 0.15), ("high", 0.6)):
        os.makedirs(os.path.join(folder, label))
        for i in range(18):
            n = int(rng.integers(40, 61))
            clip = 0.5 * np.sin(pitch * np.arange(n) + rng.uniform(0, 6)) + rng.normal(0, 0.05, size=n)
            with wave.open(os.path.join(folder, label, f"{i:03d}.wav"), "wb") as f:
                f.setnchannels(1)
                f.setsampwidth(2)
                f.setframerate(8000)
                f.writeframes((np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes())


def text_datasets(folder: str):
    """``text_dataset_from_directory`` (strings), made numbers in the pipeline by a ``TextVectorization``
    layer with a fixed vocabulary, as keras.io's text examples do."""
    train, val = keras.utils.text_dataset_from_directory(folder, batch_size=8, validation_split=0.25,
                                                         subset="both", seed=2, shuffle=True)
    vectorize = keras.layers.TextVectorization(vocabulary=["good", "great", "fine", "bad", "awful", "poor", "the",
                                                           "film", "was", "a"], output_mode="count")

    def numbers(text, label):
        return vectorize(text), label

    return train.map(numbers), val.map(numbers)


def timeseries_dataset():
    """``timeseries_dataset_from_array``: windows of 6 steps of a 3-feature series, a seeded shuffle."""
    series = np.random.default_rng(10).normal(size=(120, 3)).astype("float32")
    targets = (series[:, 0] > 0).astype("int64")
    return keras.utils.timeseries_dataset_from_array(series, targets[5:], sequence_length=6, batch_size=16,
                                                     shuffle=True, seed=4)


def build(shape, classes):
    keras.utils.set_random_seed(6)
    layers = [keras.Input(shape)]
    if len(shape) == 3:
        layers += [keras.layers.Rescaling(1 / 255.0), keras.layers.Conv2D(4, 3, activation="relu"),
                   keras.layers.GlobalAveragePooling2D()]
    elif len(shape) == 2:
        layers += [keras.layers.Flatten()]
    layers += [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(classes, activation="softmax")]
    return keras.Sequential(layers)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--fail", action="store_true")
    a = p.parse_args()
    x, y = make_data()
    rank, results = 0, {}
    model = None
    with tempfile.TemporaryDirectory(prefix="tfdata-images-") as folder:
        write_images(os.path.join(folder, "images"))
        write_texts(os.path.join(folder, "texts"))
        write_audio(os.path.join(folder, "audio"))
        for kind in KINDS:  # images last: evaluated
            shape = {"images": (8, 8, 3), "images_grain": (8, 8, 3), "text": (11,), "timeseries": (6, 3),
                     "audio": (48, 1)}
            model = build(shape.get(kind, (4,)), 2)
            if not a.plain:
                import multigpu

                model = multigpu.parallelize(model, timeout=60)
                rank = multigpu.rank()
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
            tf.random.set_seed(4)
            if kind == "map":
                history = model.fit(pipeline(x, y, fail=a.fail), epochs=2, verbose=0,
                                    validation_data=pipeline(x[:40], y[:40]))
            elif kind == "repeat":
                # 12 batches per repetition: the batches Keras reads of the pass it opens to build the model
                # (and tf.data's own read-ahead) stay inside the first repetition, whose end draws the next
                # shuffle seed from the state every iterator of the dataset shares.
                history = model.fit(pipeline(x, y, batch=8).repeat(), epochs=3, steps_per_epoch=5, verbose=0)
            elif kind == "text":
                train, val = text_datasets(os.path.join(folder, "texts"))
                history = model.fit(train, epochs=2, verbose=0, validation_data=val)
            elif kind == "timeseries":
                history = model.fit(timeseries_dataset(), epochs=2, verbose=0)
            elif kind == "audio":
                train, val = keras.utils.audio_dataset_from_directory(
                    os.path.join(folder, "audio"), batch_size=8, output_sequence_length=48, validation_split=0.25,
                    subset="both", seed=3, shuffle=True)
                history = model.fit(train, epochs=2, verbose=0, validation_data=val)
            else:
                train, val = keras.utils.image_dataset_from_directory(
                    os.path.join(folder, "images"), image_size=(8, 8), batch_size=12, validation_split=0.25,
                    subset="both", seed=1, shuffle=True, format="grain" if kind == "images_grain" else "tf")
                history = model.fit(train, epochs=2, verbose=0, validation_data=val)
            results[kind] = np.concatenate([w.ravel() for w in model.get_weights()])
            results[f"{kind}_history"] = json.dumps(history.history)
    evaluation = model.evaluate(tf.data.Dataset.from_tensor_slices((np.zeros((30, 8, 8, 3), "float32") + 90,
                                                                     np.zeros(30, "int64"))).batch(7),
                                verbose=0, return_dict=True)
    results["evaluate"] = json.dumps({k: float(v) for k, v in evaluation.items()})
    images = np.random.default_rng(8).uniform(0, 255, size=(23, 8, 8, 3)).astype("float32")
    results["predict"] = model.predict(tf.data.Dataset.from_tensor_slices(images).batch(10), verbose=0)
    np.savez(a.out if rank == 0 else f"{a.out}.rank{rank}.npz", **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
