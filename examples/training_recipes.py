"""Mixed precision, gradient accumulation and TensorBoard on several devices: Keras's own features, unchanged.

    python examples/training_recipes.py --devices cpu:0,cpu:1 --ratios 3,1 --accumulate 4 --tensorboard logs
    python examples/training_recipes.py --devices cpu:0,cpu:1 --mixed-precision
    python examples/training_recipes.py --devices cpu:0 --accumulate 4      # one device: plain Keras

Each is set as on one device: a dtype policy (``keras.mixed_precision``), the
optimizer's ``gradient_accumulation_steps``, a ``keras.callbacks.TensorBoard``
callback.  ``batch_size`` is the global batch; with ``shuffle=False`` the
devices take the same rows in the same order as one device, so the weights
they save equal one device's (``tests/test_recipes.py`` compares them).  The
TensorBoard callback writes from rank 0 only, one set of event files.  Docs:
``docs/guides/training.md``.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

import multigpu

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--devices", default="auto", help="e.g. cpu:0,cpu:1 or 0,1 (default: auto)")
parser.add_argument("--ratios", default=None, help="e.g. 3,1 (default: measured when the devices differ)")
parser.add_argument("--mixed-precision", action="store_true", help="compute in float16, keep float32 weights")
parser.add_argument("--accumulate", type=int, default=1, help="apply the summed gradients every N steps")
parser.add_argument("--tensorboard", default=None, help="a folder for TensorBoard's logs (needs tensorflow)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
parser.add_argument("--out", default="recipes.weights.h5", help="where the final weights go")
parser.add_argument("--quick", action="store_true", help="fewer rows, for the tests")
args = parser.parse_args()

if args.mixed_precision:
    keras.mixed_precision.set_global_policy("mixed_float16")  # float16 compute, float32 weights, loss scaling

rows = 512 if args.quick else 8192
rng = np.random.default_rng(0)
x = rng.standard_normal((rows, 32)).astype("float32")
y = (x[:, :10].argmax(axis=1) + (x[:, 10] > 1)) % 10  # a learnable rule

keras.utils.set_random_seed(1)
model = keras.Sequential([
    keras.Input((32,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(10),
    keras.layers.Activation("linear", dtype="float32"),  # logits in float32 under mixed precision
])
model = multigpu.parallelize(model, devices=args.devices.split(","),
                             ratios=None if args.ratios is None else [float(r) for r in args.ratios.split(",")])
optimizer = keras.optimizers.SGD(0.05, momentum=0.9,
                                 gradient_accumulation_steps=args.accumulate if args.accumulate > 1 else None)
model.compile(optimizer=optimizer, metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
callbacks = [keras.callbacks.TensorBoard(args.tensorboard)] if args.tensorboard else []
history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, callbacks=callbacks,
                    verbose=0)
model.save_weights(args.out)  # every rank calls it; rank 0 writes the one file
if multigpu.rank() == 0:
    print(f"{type(model.optimizer).__name__}, policy {keras.config.dtype_policy().name}, "
          f"accumulating {args.accumulate} step(s)")
    print(f"final loss {history.history['loss'][-1]:.6f}, accuracy {history.history['accuracy'][-1]:.4f}")
