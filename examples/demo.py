"""The main demo (`make demo`): a convnet on Fashion-MNIST across this machine's devices.

    make demo
    KERAS_BACKEND=torch python examples/demo.py [--devices cpu:0,cpu:1@0.5] [--epochs 2] [--rows 12000]
    KERAS_BACKEND=tensorflow make demo        # the same on Keras's TensorFlow backend (jax works too)

With GPUs it uses all of them; on a CPU-only machine two CPU devices, the
second limited to half speed (a cgroup CPU quota, so that balancing shows;
without root it runs both at full speed and says so).  Shares are measured
(`ratios="auto"`).  It prints the devices, their shares and samples/s, the
speedup against one device measured in the same run, the test accuracy, and
where it saved the model and a PNG of throughput per device.  On a CPU it
trains a narrower network (`--width`) on a subset of the data, as it says on
screen, so that it finishes in a few minutes.  Every process it starts asks
torch's CPU allocator for huge pages (``THP_MEM_ALLOC_ENABLE=1``, unless set):
without them a fresh process's speed on a CPU moves with where its pages land.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")
# torch's CPU allocator backs tensors of 2 MB and more with huge pages: without them a process's speed on a CPU
# depends on where its 4 KB pages land (the one-device run spread 1558 to 1998 samples/s between fresh processes,
# 2291 to 2316 with them).  Set here, before torch allocates, so every process of the demo has it: the ranks
# and the one-device run alike.  Other backends ignore it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import keras
import numpy as np
from _common import FASHION_MNIST, read_fashion_mnist

import multigpu


def cuda_device_count() -> int:
    """The GPUs multigpu can use here."""
    return sum(d.is_cuda for d in multigpu.list_devices())


ALONE_STEPS = 20  # timed steps of the one-device run (after 3 untimed ones)
# On a CPU: chosen by benchmarks/bench_demo.py (see benchmarks/demo/README.md) so that two devices pay.
DEFAULTS = {"cpu_width": 1.0, "batch": 512, "rows": 60000, "epochs": 4}


def build_model(width: float) -> keras.Model:
    """A small convnet for Fashion-MNIST (``width`` scales its filters, 32 and 64 at width 1).

    Two convolutions, each followed by max-pooling, and a dense layer: it
    reaches about 0.9 in three or four epochs at a quarter of the cost per sample of
    ``multigpu bench``'s convnet at width 0.25, which reached only 0.87 in the
    time the demo has.  No dropout (four epochs do not overfit), and
    BatchNormalization's moving statistics follow the batches faster than
    Keras's default (momentum 0.9: at 0.99 they still lag after a few hundred
    steps, and the evaluated loss is several times the training loss, in plain
    Keras as under multigpu).
    """
    L = keras.layers
    inputs = keras.Input((28, 28, 1))
    h = L.Conv2D(max(1, round(32 * width)), 3, activation="relu")(inputs)
    h = L.MaxPooling2D(2)(h)
    h = L.Conv2D(max(1, round(64 * width)), 3, activation="relu")(h)
    h = L.BatchNormalization(momentum=0.9)(h)
    h = L.MaxPooling2D(2)(h)
    h = L.Flatten()(h)
    h = L.Dense(128, activation="relu")(h)
    outputs = L.Dense(10, activation="softmax")(h)
    return keras.Model(inputs, outputs, name="fashion_convnet")


def compile_model(model: keras.Model, a: argparse.Namespace) -> None:
    """Adam from 3e-3 down to 0 on a cosine over the run's steps (468 at the defaults: a global batch of 512
    takes few steps, so each goes further, and the decay lets the last epoch settle)."""
    steps = -(-int(a.rows * 0.9) // a.batch_size) * a.epochs  # 10% of the rows are for validation
    schedule = keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=steps)
    model.compile(optimizer=keras.optimizers.Adam(schedule), loss="categorical_crossentropy", metrics=["accuracy"])


def can_throttle() -> bool:
    """Whether a CPU device can be slowed here (``cpu:1@0.5``): root, and a cgroup cpu controller (v1's
    ``cpu.cfs_quota_us``, or ``cpu`` among v2's controllers)."""
    if os.geteuid() != 0:
        return False
    root = Path("/sys/fs/cgroup")
    if any((root / name / "cpu.cfs_quota_us").exists() for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")):
        return True
    controllers = [root / "cgroup.controllers", root / "unified" / "cgroup.controllers"]
    return any(path.exists() and "cpu" in path.read_text().split() for path in controllers)


def default_devices() -> tuple[list[str], str]:
    if cuda_device_count():
        return [f"cuda:{i}" for i in range(cuda_device_count())], "all GPUs"
    if can_throttle():
        return ["cpu:0", "cpu:1@0.5"], "two CPU devices, the second at half speed (cgroup CPU quota)"
    return ["cpu:0", "cpu:1"], "two CPU devices at full speed (no root or no cgroup cpu controller: cannot throttle)"


def load_data(rows: int, say):
    found = read_fashion_mnist()
    if found is not None:
        (x, y), (xt, yt) = found
        say(f"data: Fashion-MNIST, {min(rows, len(x))} of {len(x)} training images, {len(xt)} test images")
    else:
        say(f"data: Fashion-MNIST not found (no IDX files in {' or '.join(FASHION_MNIST)}: apt-get install "
            "dataset-fashion-mnist); using synthetic data instead")
        rng = np.random.default_rng(0)
        x = rng.integers(0, 255, size=(rows + 2000, 28, 28), dtype=np.uint8)
        y = (x[:, 10:18, 10:18].mean(axis=(1, 2)) / 26).astype("int64").clip(0, 9)
        x, xt, y, yt = x[:rows], x[rows:], y[:rows], y[rows:]
    x, y = x[:rows], y[:rows]
    prep = lambda a: (a.astype("float32") / 255.0)[..., None]  # noqa: E731
    return prep(x), keras.utils.to_categorical(y, 10), prep(xt), keras.utils.to_categorical(yt, 10)


ONE_DEVICE_VAR = "MULTIGPU_DEMO_ONE_DEVICE"  # the rate of one device alone, measured before the ranks start


def one_device_rate(a: argparse.Namespace) -> float:
    """Samples/s of plain Keras ``fit`` on one full-speed core: same model, data and batch, in a subprocess."""
    with tempfile.TemporaryDirectory(prefix="demo-alone-") as tmp:
        out = Path(tmp) / "alone.json"
        command = [sys.executable, os.path.abspath(__file__), "--alone", str(out), "--width", str(a.width),
                   "--batch-size", str(a.batch_size), "--rows", str(a.rows)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MULTIGPU_")}
        env.update(OMP_NUM_THREADS="1", KERAS_BACKEND=keras.backend.backend())
        # Its output only where it fails: TensorFlow's start-up lines, which this process printed already, else.
        done = subprocess.run(command, env=env, preexec_fn=lambda: os.sched_setaffinity(0, {0}), check=False,
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.stdout.write(done.stdout)
            sys.stderr.write(done.stderr)
            raise subprocess.CalledProcessError(done.returncode, command)
        return float(json.loads(out.read_text())["samples_per_second"])


def train_alone(a: argparse.Namespace) -> None:
    """``--alone``: the first ``ALONE_STEPS`` steps of the same training, plain Keras, one thread."""
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(1)
    elif keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    x, y, _, _ = load_data(a.rows, lambda *_: None)
    model = build_model(a.width)
    compile_model(model, a)
    meter = Throughput(a.batch_size)
    rows = a.batch_size * (ALONE_STEPS + 3)
    model.fit(x[:rows], y[:rows], batch_size=a.batch_size, epochs=1, callbacks=[meter], verbose=0)
    Path(a.alone).write_text(json.dumps({"samples_per_second": meter.rate()}))


class Throughput(keras.callbacks.Callback):
    """Samples/s of the training steps: at the median step of the last ``epochs`` epochs (the headline: a
    slowdown of the machine over fewer than half of those steps does not move it), and end to end over the
    last epoch (validation and each epoch's first steps, calibration and warm-up, left out of both)."""

    def __init__(self, batch: int, skip: int = 3, epochs: int = 3) -> None:
        super().__init__()
        self.batch, self.skip, self.epochs = batch, skip, epochs
        self.times: list[float] = []
        self.durations: list[np.ndarray] = []  # each epoch's step durations

    def on_epoch_begin(self, epoch, logs=None):
        self.times = []

    def on_train_batch_end(self, step, logs=None):
        self.times.append(time.perf_counter())

    def on_epoch_end(self, epoch, logs=None):
        self.durations.append(np.diff(self.times[self.skip :]))

    def rate(self) -> float:
        """At the median step of the last epochs."""
        steps = np.concatenate([np.zeros(0), *self.durations[-self.epochs :]])
        return self.batch / float(np.median(steps)) if steps.size else float("nan")

    def wall_rate(self) -> float:
        """End to end over the last epoch."""
        t = self.times[self.skip :]
        return self.batch * (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else float("nan")


def plot(path: Path, labels, computing, alone, total: float, one: float) -> None:
    """The table's numbers as bars: each device computing in this run beside alone, then the run's total."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = list(range(len(labels)))
    ax.bar([x - 0.2 for x in xs], computing, 0.4, color="tab:blue", label="computing, in this run")
    ax.bar([x + 0.2 for x in xs], alone, 0.4, color="tab:gray", label="alone (mean of runs before and after training)")
    ax.bar([len(labels)], [total], 0.6, color="tab:green", label="all devices, end to end")
    ax.bar([len(labels) + 1], [one], 0.6, color="tab:olive", label="one full-speed device, end to end")
    ax.set_xticks([*xs, len(labels), len(labels) + 1], [*labels, "total", "1 device"])
    for x, v in [*zip([x - 0.2 for x in xs], computing), *zip([x + 0.2 for x in xs], alone),
                 (len(labels), total), (len(labels) + 1, one)]:
        ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("samples/s")
    ax.set_title("multigpu demo: samples/s per device and in total")
    finite = [v for v in [*computing, *alone, total, one] if math.isfinite(v)]
    ax.set_ylim(0, 1.45 * max(finite, default=1.0))  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default=None, help="comma-separated (default: see above)")
    p.add_argument("--ratios", default="auto")
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    p.add_argument("--rows", type=int, default=DEFAULTS["rows"], help="training rows (at most 60000)")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch"], help="global batch")
    p.add_argument("--width", type=float, default=None,
                   help=f"filter scale (default: 1 on GPU, {DEFAULTS['cpu_width']:g} on CPU)")
    p.add_argument("--out", default="demo-output")
    p.add_argument("--alone", default=None, help=argparse.SUPPRESS)  # the one-device run's result file
    a = p.parse_args()
    if a.epochs < 1 or a.rows < a.batch_size or a.batch_size < 2:
        p.error(f"need --epochs >= 1, --batch-size >= 2 and --rows >= --batch-size. Received: --epochs {a.epochs} "
                f"--rows {a.rows} --batch-size {a.batch_size}")
    a.width = a.width or (1.0 if cuda_device_count() else DEFAULTS["cpu_width"])
    return a


def report(state, batch: int, total: float, one: float | None, alone_runs: tuple[float, ...] = (),
           wall: float | None = None) -> None:
    """Shares, each device's speed in the run beside alone, the total and the speedup, with what it measured.

    ``total`` is the run's rate at its median step (over its last three epochs), ``wall`` its rate end to end
    over the last epoch; ``alone_runs``: the one-device rates (each at its median step) measured before and
    after training, whose mean is ``one``: their spread is printed beside the speedup, so a machine whose speed
    drifts during the run shows it.
    """
    last = (state.last_report or {}).get("devices") or []
    shares = state.shares(batch)
    print(f"\n{'device':<12}{'share':>7}{'batch':>7}{'computing':>11}{'alone':>9}{'waiting':>9}")
    for i, (dev, s) in enumerate(zip(state.devices, shares)):
        row = last[i] if i < len(last) else {}
        step = (row.get("compute", 0) + row.get("wait", 0)) or 1.0
        alone = f"{one * dev.speed:.0f}" if one else "-"
        print(f"{dev.label:<12}{s / batch:>7.0%}{s:>7}{row.get('compute_samples_per_second', 0):>9.0f}/s"
              f"{alone:>7}/s{row.get('wait', 0) / step:>9.0%}")
    print(f"{'total':<12}{'100%':>7}{batch:>7}{total:>9.0f}/s  (the median training step of the last three epochs"
          + (f"; {wall:.0f}/s end to end over the last epoch)" if wall else ")"))
    print("(computing: samples/s while computing in this run; alone: one full-speed device alone, the mean of "
          "its runs before and after training, times the device's speed factor)")
    if not one:
        return
    ideal = sum(d.speed for d in state.devices)
    speedup = total / one
    computing = sum(r.get("compute_samples_per_second", 0) for r in last)
    waiting = max((r.get("wait", 0) / ((r.get("compute", 0) + r.get("wait", 0)) or 1.0) for r in last), default=0)
    pace = computing / (one * ideal)
    # Within 5% of the speed alone is the runs' own spread, not the replay (which exists on torch only).
    replayed = pace > 1.05 and keras.backend.backend() == "torch"
    why = ("multigpu replays the forward pass without Keras's per-operation work, and the cores share caches and "
           "memory bandwidth" if replayed else "the cores share caches and memory bandwidth")
    where = (f"the devices computed at {pace:.0%} of their speed alone ({why}), waited up to {waiting:.0%} of a "
             "step, and the rest is per-step work")
    spread = ""
    if len(alone_runs) > 1:
        low, high = total / max(alone_runs), total / min(alone_runs)
        spread = (f" (one device alone ran {', '.join(f'{r:.0f}' for r in alone_runs)} samples/s before and after "
                  f"training: {low:.2f}x to {high:.2f}x by either alone"
                  + (f"; {wall / one:.2f}x end to end over the last epoch" if wall else "") + ")")
    if speedup >= 1.0:
        print(f"speedup: {speedup:.2f}x against one full-speed device alone ({one:.0f} samples/s, same model, data "
              f"and batch){spread}; the speed factors add up to {ideal:.2f}: {where}.")
    else:
        print(f"no speedup on this machine: the {len(state.devices)} devices ran {total:.0f} samples/s, one "
              f"full-speed device alone {one:.0f} ({speedup:.2f}x). Measured: {where}. A larger --batch-size or "
              "--width gives each step more work per byte and per step, which is when devices pay.")


def main() -> int:
    a = parse_args()
    if a.alone:
        train_alone(a)
        return 0
    on_gpu = cuda_device_count() > 0
    devices, why = (a.devices.split(","), "as asked") if a.devices else default_devices()
    say = print if multigpu.rank() == 0 else (lambda *_: None)
    if multigpu.rank() == 0 and os.environ.get("MULTIGPU_RANK") is None and ONE_DEVICE_VAR not in os.environ:
        # Before parallelize: here, in the process that starts the ranks, so nothing else runs meanwhile.
        say(f"devices: {', '.join(devices)} ({why})")
        if not on_gpu:
            say(f"on CPU: network width {a.width:g} (filters scaled), {a.rows} training rows, {a.epochs} epoch(s), "
                f"global batch {a.batch_size}")
            say(f"measuring one full-speed device alone ({ALONE_STEPS} steps of the same training) ...")
            os.environ[ONE_DEVICE_VAR] = f"{one_device_rate(a):.3f}"
    one = float(os.environ.get(ONE_DEVICE_VAR, "0")) or None
    keras.utils.set_random_seed(0)
    model = build_model(a.width)
    ratios = None if a.ratios == "auto" else [float(r) for r in a.ratios.split(",")]
    model = multigpu.parallelize(model, devices=devices, ratios=ratios if ratios else "auto")
    compile_model(model, a)
    x, y, xt, yt = load_data(a.rows, say)
    meter = Throughput(a.batch_size)
    model.fit(x, y, batch_size=a.batch_size, epochs=a.epochs, validation_split=0.1,
              callbacks=[meter], verbose=2 if multigpu.rank() == 0 else 0)
    loss, acc = model.evaluate(xt, yt, batch_size=1024, verbose=0)
    out = Path(a.out)
    if multigpu.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    model.save(out / "fashion_convnet.keras")
    if multigpu.rank() != 0:
        return 0
    state = multigpu.state(model)
    total = meter.rate()
    alone_runs: tuple[float, ...] = ()
    if one:  # measured again now, on the same core, while the other ranks wait: a drift of the machine cancels
        alone_runs = (one, one_device_rate(a))
        one = sum(alone_runs) / len(alone_runs)
    report(state, a.batch_size, total, one, alone_runs, meter.wall_rate())
    print(f"test accuracy: {acc:.4f} (loss {loss:.4f})")
    last = (state.last_report or {}).get("devices") or [{} for _ in state.devices]
    computing = [row.get("compute_samples_per_second", 0.0) for row in last]
    alone = [(one or float("nan")) * d.speed for d in state.devices]
    plot(out / "throughput.png", [d.label for d in state.devices], computing, alone, total, one or float("nan"))
    print(f"saved the model to {out / 'fashion_convnet.keras'} and the plot to {out / 'throughput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
