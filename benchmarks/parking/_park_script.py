"""One run of bench_park.py: a model trained for EPOCHS epochs of STEPS steps at BATCH, plain Keras on one device
(``single``) or through multigpu on ``cpu:0`` and ``cpu:1`` with automatic shares (``auto``).

    python _park_script.py MODE MODEL WIDTH BATCH STEPS EPOCHS OUT [SECOND [FIRST [THIRD]]]

SECOND: the second device (default ``cpu:1``; ``cpu:1@0.2`` for one at a fifth of a core); FIRST: the first
(default ``cpu:0``; ``cpu:0@0.2``: the slow device listed first, the leader); THIRD: a third device (none by
default; ``cpu:2@0.1``: a tenth of a core).

Rank 0 writes the samples/s of the last ``LAST`` epochs (their rows over their wall time), each epoch's time, and
the shares after the fit to OUT (JSON).
"""

import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras

from multigpu.bench.models import get_model

LAST = 3
mode, name, width, batch, steps, epochs, out = (sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]),
                                                int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
second = sys.argv[8] if len(sys.argv) > 8 else "cpu:1"
first = sys.argv[9] if len(sys.argv) > 9 else "cpu:0"
third = sys.argv[10:11]
if mode == "single" and keras.backend.backend() == "tensorflow":
    # TensorFlow's pools sized to the one core bench_park.py pins it to, as multigpu's ranks and
    # bench_overhead.py's single size theirs (plain Keras on the MLP at batch 64 ran 7,800 to 17,100 samples/s
    # with them and 8,000 to 17,000 without, from round to round: the machine, not the pools).
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
spec = get_model(name)
keras.utils.set_random_seed(0)
x, y = spec.data(batch * steps, 0)
model = spec.build(width)
if mode == "auto":
    import multigpu

    model = multigpu.parallelize(model, devices=[first, second, *third], ratios="auto")
spec.compile(model)


class EpochTimes(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.began = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.began)


timer = EpochTimes()
timer.times = []
model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[timer])
if mode != "auto" or multigpu.rank() == 0:
    with open(out, "w") as f:
        json.dump({"samples_per_second": batch * steps * LAST / sum(timer.times[-LAST:]), "epochs": timer.times,
                   "judgment": multigpu.state(model).judgment if mode == "auto" else None,
                   "shares": list(multigpu.state(model).ratios) if mode == "auto" else [1.0]}, f)
