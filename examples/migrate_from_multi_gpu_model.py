"""An old ``keras.utils.multi_gpu_model`` script, moved to multigpu by changing one import.

    KERAS_BACKEND=torch python examples/migrate_from_multi_gpu_model.py              # every device
    KERAS_BACKEND=torch python examples/migrate_from_multi_gpu_model.py --quick      # a few seconds of training
    KERAS_BACKEND=torch python examples/migrate_from_multi_gpu_model.py --gpus 2 --ratios 768,560
    KERAS_BACKEND=torch python examples/migrate_from_multi_gpu_model.py --devices cpu:0,cpu:1@0.5 --ratios 2,1

Everything below the import is written the way Keras 2 scripts used ``multi_gpu_model``
(with the community ``ratios=`` patch): build a template model, wrap it, compile and fit
the wrapped model, save the *template*.  With multigpu the wrapped model is the template
itself, trained data-parallel; the saved file is a plain Keras file, and the script loads
it back and checks its predictions.  ``--gpus N`` takes the first N GPUs (N CPU devices on
a machine without GPUs); ``--devices`` names them instead.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from _common import add_device_arguments

import multigpu

# from keras.utils import multi_gpu_model          # Keras 2: the only line that changes
from multigpu import multi_gpu_model


def build_model(hidden: int) -> keras.Model:
    return keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ], name="template")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=None, help="how many devices, the first ones (old style)")
    add_device_arguments(p, ratios_help="e.g. 768,560 (default: equal shares)", devices_example="0,1 or cpu:0,cpu:1")
    p.add_argument("--epochs", type=int, default=None, help="default 5 (3 with --quick)")
    p.add_argument("--rows", type=int, default=None, help="synthetic rows (default 20000; 2048 with --quick)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--save-to", default="migrated_model.keras", help="where to save the template model")
    p.add_argument("--quick", action="store_true", help="a small model on few rows")
    args = p.parse_args()
    epochs = args.epochs or (3 if args.quick else 5)
    rows = args.rows or (2048 if args.quick else 20000)
    hidden = 32 if args.quick else 256
    # The old script's `G`: a number of GPUs, or here also a list of devices.
    gpus: int | list[str] | None = args.gpus if args.gpus is not None else (
        None if args.devices == "auto" else args.devices)

    # ---- the Keras 2 script, unchanged from here on ----
    np.random.seed(0)
    x = np.random.normal(size=(rows, 32)).astype("float32")
    y = keras.utils.to_categorical(np.argmax(x[:, :3], axis=1), 3)

    template = build_model(hidden)  # Keras 2: built under `with tf.device("/cpu:0"):`, not needed now
    parallel_model = multi_gpu_model(template, gpus=gpus, ratios=args.ratios)
    parallel_model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    parallel_model.fit(x, y, batch_size=args.batch_size, epochs=epochs, verbose=2)
    template.save(args.save_to)  # save the template model, as the old docs said (written once, by rank 0)
    # ---- end of the old script ----

    # Every rank takes part in predict (it is split across the devices); rank 0 checks the file.
    expected = parallel_model.predict(x[:64], batch_size=32, verbose=0)
    if multigpu.rank() == 0:
        print(f"trained with {multigpu.state(template).describe()}")
        print(f"parallel_model is template: {parallel_model is template}")
        loaded = keras.models.load_model(args.save_to)  # a plain Keras file: multigpu is not needed to load it
        got = loaded.predict(x[:64], verbose=0)
        same = np.allclose(got, expected, atol=1e-5)
        accuracy = float(np.mean(np.argmax(got, axis=1) == np.argmax(y[:64], axis=1)))
        print(f"saved {args.save_to}; loaded it back: {type(loaded).__name__} {loaded.name!r}, "
              f"{loaded.count_params():,} parameters, predictions match: {same}, accuracy on 64 rows: {accuracy:.3f}")
        if not same:
            raise SystemExit("the loaded model's predictions differ from the trained model's")


if __name__ == "__main__":
    main()
