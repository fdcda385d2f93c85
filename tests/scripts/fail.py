"""Runs that must fail, cleanly and within their timeout (used by the reliability tests).

    python fail.py MODE [--timeout 10]

Modes:
  mismatch     a train_step that calls the optimizer on other variables on rank 1
  extra_call   a train_step that calls the optimizer once more on rank 1
  sleep        rank 1 sleeps in a callback for longer than the timeout
  catch        rank 0 catches the timeout of its own collective in a callback, then goes on training
  hang_exit    rank 1 raises, then hangs in an atexit handler (a rank stuck in teardown)
  nan_logs     a train_step that logs a vector
"""

import argparse
import atexit
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch
from seeding import set_random_seed

import multigpu


class Step(keras.Model):
    """A small model whose train_step can misbehave on one rank."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.a = keras.layers.Dense(4)
        self.b = keras.layers.Dense(1)

    def call(self, x):
        return self.b(self.a(x))

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = keras.ops.mean(keras.ops.square(self(x) - y))
        loss.backward()
        variables = self.trainable_weights
        if self.mode == "mismatch" and multigpu.rank() == 1:
            variables = self.a.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in variables], variables)
            if self.mode == "extra_call" and multigpu.rank() == 1:
                self.optimizer.apply([v.value.grad for v in variables], variables)
        if self.mode == "nan_logs":
            return {"loss": loss, "vector": keras.ops.ones((3,))}
        return {"loss": loss}


class Sleep(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1 and multigpu.rank() == 1:
            print("rank 1 sleeps", flush=True)
            time.sleep(self.seconds)


class Catch(keras.callbacks.Callback):
    """Rank 0 evaluates inside a callback while rank 1 sleeps, and tries to catch the timeout."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        if batch != 1:
            return
        if multigpu.rank() == 1:
            time.sleep(self.seconds)
            return
        try:
            self.model.evaluate(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), verbose=0)
        except Exception as exc:  # the run must end anyway: a timed-out group is never used again
            print(f"rank 0 caught: {str(exc).splitlines()[0][:80]}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("--timeout", type=float, default=10)
    a = p.parse_args()
    set_random_seed(0)
    model = Step(a.mode) if a.mode in ("mismatch", "extra_call", "nan_logs") else keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model = multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], ratios=[1, 1], timeout=a.timeout)
    model.compile(optimizer="sgd", loss="mse")
    if a.mode == "hang_exit" and multigpu.rank() == 1:
        atexit.register(time.sleep, 3600)
        raise RuntimeError("rank 1 fails, then hangs at exit")
    x = np.ones((64, 3), "float32")
    y = np.ones((64, 1), "float32")
    callbacks = {"sleep": [Sleep(3 * a.timeout)], "catch": [Catch(3 * a.timeout)]}.get(a.mode, [])
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    print(f"rank {multigpu.rank()} finished training", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
