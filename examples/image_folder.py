"""An image classifier trained from a folder of image files with Keras's ``image_dataset_from_directory``.

    KERAS_BACKEND=torch python examples/image_folder.py --devices cpu:0,cpu:1 --ratios 3,1
    KERAS_BACKEND=jax python examples/image_folder.py --quick        # about a minute on 2 CPU cores

The example first writes a folder of PNG files, one sub-folder per class, from Fashion-MNIST (Debian's
``dataset-fashion-mnist``; simple synthetic images when it is not installed), as a user's own photos
would sit on disk.  Then the usual Keras code: ``keras.utils.image_dataset_from_directory`` with a
validation split and a seeded shuffle, ``cache`` and ``prefetch`` on the ``tf.data`` pipeline, a small
convnet; ``fit``, ``evaluate`` and ``predict`` take the datasets as they are.  Each global batch is read
once per machine and cut by the shares (see the README's "Input pipelines").  Needs TensorFlow for
``tf.data`` (``pip install tensorflow-cpu``; ``make`` installs it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import tensorflow as tf
from _common import add_device_arguments, apply_quick_defaults, read_fashion_mnist

import multigpu

CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]


def write_folder(folder: str, per_class: int) -> str:
    """``per_class`` PNG files per class under ``folder/<class>/``; returns where they came from.

    The script runs once to start the devices and once on each of them: the first run writes the folder
    (into a folder of its own, renamed into place, so it is never seen half-written) and the others find it.
    """
    if os.path.isdir(folder):
        return "written earlier"
    found = read_fashion_mnist()
    if found is not None:
        (images, labels), _ = found
        source = "Fashion-MNIST"
    else:
        rng = np.random.default_rng(0)
        labels = np.repeat(np.arange(len(CLASSES)), per_class)
        images = np.clip(rng.normal(20 * labels[:, None, None], 40, size=(len(labels), 28, 28)), 0, 255)
        source = "synthetic images"
    staging = tempfile.mkdtemp(prefix=os.path.basename(folder) + "-", dir=os.path.dirname(folder))
    for c, name in enumerate(CLASSES):
        os.makedirs(os.path.join(staging, name))
        for i, index in enumerate(np.flatnonzero(labels == c)[:per_class]):
            pixels = images[index].astype("uint8")[:, :, None]
            keras.utils.save_img(os.path.join(staging, name, f"{i:05d}.png"), pixels, scale=False)
    try:
        os.rename(staging, folder)
    except OSError:  # another rank's folder is there already
        shutil.rmtree(staging, ignore_errors=True)
    return source


def build() -> keras.Model:
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Rescaling(1 / 255.0),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(len(CLASSES)),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_arguments(p)
    p.add_argument("--per-class", type=int, default=None, help="images per class (default 1000; 200 with --quick)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--epochs", type=int, default=None, help="default 6 (5 with --quick)")
    p.add_argument("--folder", default=None, help="where the images go (default: under the temporary folder)")
    p.add_argument("--quick", action="store_true", help="fewer images: about a minute")
    a = p.parse_args(argv)
    apply_quick_defaults(a, {"per_class": (1000, 200), "epochs": (6, 5)})
    if min(a.per_class, a.batch_size, a.epochs) < 1:
        p.error("--per-class, --batch-size and --epochs must be positive")
    return a


def main() -> None:
    args = parse_args()
    folder = args.folder or os.path.join(tempfile.gettempdir(), f"multigpu-image-folder-{args.per_class}")
    source = write_folder(folder, args.per_class)
    train, val = keras.utils.image_dataset_from_directory(
        folder, color_mode="grayscale", image_size=(28, 28), batch_size=args.batch_size,
        validation_split=0.2, subset="both", seed=1337, verbose=False)
    train = train.cache().prefetch(tf.data.AUTOTUNE)
    val = val.cache().prefetch(tf.data.AUTOTUNE)
    keras.utils.set_random_seed(0)
    model = multigpu.parallelize(build(), devices=args.devices, ratios=args.ratios)
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    rank0 = multigpu.rank() == 0
    state = multigpu.state(model)
    if rank0:
        print(f"{len(CLASSES) * args.per_class} images in {folder} ({source})", flush=True)
        print(state.describe(), flush=True)
    began = time.perf_counter()
    model.fit(train, epochs=args.epochs, validation_data=val, verbose=2 if rank0 else 0)
    seconds = time.perf_counter() - began
    _, accuracy = model.evaluate(val, verbose=0)
    predicted = np.argmax(model.predict(val.take(1), verbose=0), axis=-1)
    if rank0:
        print(f"trained {args.epochs} epochs in {seconds:.1f} s on {state.world_size} device(s)")
        print(f"validation accuracy: {accuracy:.3f}")
        print("first predictions: " + ", ".join(CLASSES[i] for i in predicted[:5]))


if __name__ == "__main__":
    main()
