"""What every benchmark run shares: a callback timing the steady-state steps, and rank 0's result file."""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["timer", "write"]


def timer(batch: int, warmup: int, print_every: int, parallel_model=None, breakdown=None):
    """A Keras callback noting when each training step ends; ``rate()`` is the samples/s after ``warmup``."""
    import keras

    class Timer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.samples = 0
            self.loss = float("nan")
            self.next_print = print_every

        def on_train_batch_end(self, step, logs=None):
            self.times.append(time.perf_counter())
            if breakdown is not None and len(self.times) == warmup + 1:
                breakdown.reset()  # the phases of the timed steps only
            self.samples += batch
            self.loss = float((logs or {}).get("loss", float("nan")))
            if print_every and self.samples >= self.next_print and len(self.times) > warmup + 1:
                self.next_print += print_every
                progress(self.samples, batch, self.rate(), parallel_model)

        def rate(self) -> float:
            timed = self.times[warmup:]
            if len(timed) < 2:
                return float("nan")
            return batch * (len(timed) - 1) / (timed[-1] - timed[0])

    return Timer()


def progress(samples: int, batch: int, total_rate: float, model) -> None:
    import multigpu

    if multigpu.rank() != 0:
        return
    print(f"After {samples} samples", flush=True)
    if model is not None:
        st = multigpu.state(model)
        for dev, share in zip(st.devices, st.shares(batch)):
            print(f"{dev.label}[{share}] {total_rate * share / batch:.0f} sps", flush=True)
    print(f"Total:[{batch}] {total_rate:.0f} sps", flush=True)


def write(cfg: dict, result: dict) -> None:
    Path(cfg["out"]).write_text(json.dumps({"mode": cfg["mode"], "config": cfg, **result}))

