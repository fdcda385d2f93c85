"""One run of ``bench_faults.py``: the convnet of ``_input_worker.py`` on in-memory images, with a clock.

Started by ``bench_faults.py`` under ``multigpu run`` (never by hand in normal use).  The writing rank
appends one line per training step to ``--marks`` (the time the step ended, its epoch and step), across
restarts; at the end it writes the lost devices' records to ``--out``.  With ``--die-at N`` the last
rank kills itself (``SIGKILL``) as it begins its ``N``-th step, once per run (a file marks it done, so
that a restarted run goes through).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--marks", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--backup", default=None)
    p.add_argument("--die-at", type=int, default=None)
    a = p.parse_args()
    import keras
    from _input_worker import BATCH, build, images

    import multigpu

    keras.utils.set_random_seed(1)
    model = multigpu.parallelize(build(2.0))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    x, y = images()
    index = [i % len(x) for i in range(a.steps * BATCH)]

    class Clock(keras.callbacks.Callback):
        epoch = 0
        steps = 0

        def on_train_batch_begin(self, step, logs=None):
            self.steps += 1
            done = a.marks + ".died"
            last = multigpu.world_size() - 1
            if self.steps == a.die_at and multigpu.rank() == last and not os.path.exists(done):
                open(done, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, step, logs=None):
            state = multigpu.state(self.model)
            left = sorted(set(range(state.world_size)) - {e["rank"] for e in state.lost})
            if state.rank == left[0]:
                with open(a.marks, "a") as f:
                    f.write(f"{time.time()} {self.epoch} {step}\n")

    callbacks = [Clock()]
    if a.backup:
        callbacks.append(keras.callbacks.BackupAndRestore(a.backup))
    model.fit(x[index], y[index], batch_size=BATCH, epochs=a.epochs, verbose=0, shuffle=False, callbacks=callbacks)
    state = multigpu.state(model)
    if state.rank == min(set(range(state.world_size)) - {e["rank"] for e in state.lost}):
        with open(a.out, "w") as f:
            json.dump({"lost": state.lost, "joined": state.joined, "ratios": state.ratios}, f)


if __name__ == "__main__":
    main()
