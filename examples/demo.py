"""The main demo (`make demo`): a convnet on Fashion-MNIST across this machine's devices.

    make demo
    KERAS_BACKEND=torch python examples/demo.py [--devices cpu:0,cpu:1@0.5] [--epochs 2] [--rows 12000]

With GPUs it uses all of them; on a CPU-only machine two CPU devices, the
second limited to half speed (a cgroup CPU quota, so that balancing shows;
without root it runs both at full speed and says so).  Shares are measured
(`ratios="auto"`).  It prints the devices, their shares and samples/s, the
speedup against one device measured in the same run, the test accuracy, and
where it saved the model and a PNG of throughput per device.  On a CPU it
trains a narrower network (`--width`) on a subset of the data, as it says on
screen, so that it finishes in a few minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

import multigpu
from multigpu.bench.models import convnet
from multigpu.devices import cuda_device_count


def default_devices() -> tuple[list[str], str]:
    if cuda_device_count():
        return [f"cuda:{i}" for i in range(cuda_device_count())], "all GPUs"
    from multigpu.throttle import cgroup_status

    if os.geteuid() == 0 and "no writable" not in cgroup_status():
        return ["cpu:0", "cpu:1@0.5"], "two CPU devices, the second at half speed (cgroup CPU quota)"
    return ["cpu:0", "cpu:1"], "two CPU devices at full speed (no root or no cgroup cpu controller: cannot throttle)"


def load_data(rows: int, say):
    from multigpu.datasets import DataNotFoundError, load_mnist_like

    try:
        (x, y), (xt, yt) = load_mnist_like("fashion_mnist")
        say(f"data: Fashion-MNIST, {min(rows, len(x))} of {len(x)} training images, {len(xt)} test images")
    except DataNotFoundError as exc:
        say(f"data: Fashion-MNIST not found ({exc}); using synthetic data instead")
        rng = np.random.default_rng(0)
        x = rng.integers(0, 255, size=(rows + 2000, 28, 28), dtype=np.uint8)
        y = (x[:, 10:18, 10:18].mean(axis=(1, 2)) / 26).astype("int64").clip(0, 9)
        x, xt, y, yt = x[:rows], x[rows:], y[:rows], y[rows:]
    x, y = x[:rows], y[:rows]
    prep = lambda a: (a.astype("float32") / 255.0)[..., None]  # noqa: E731
    return prep(x), keras.utils.to_categorical(y, 10), prep(xt), keras.utils.to_categorical(yt, 10)


def one_device_rate(width: float, batch: int, cores: list[int]) -> float:
    """Samples/s of the same network on one full-speed device, alone."""
    from multigpu.bench.runs import run_config

    result = run_config({"mode": "solo", "model": "convnet", "width": width, "devices": ["cpu:0"],
                         "batch": batch, "ratios": None, "steps": 6, "warmup": 2, "cores": cores},
                        stream=False)
    return result["samples_per_second"]


class Throughput(keras.callbacks.Callback):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.times = batch, []

    def on_train_batch_end(self, step, logs=None):
        self.times.append(time.perf_counter())

    def rate(self) -> float:
        t = self.times[3:]  # after calibration and warm-up
        return self.batch * (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else float("nan")


def plot(path: Path, labels, rates, total: float, one: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [*labels, "total", "1 device alone"]
    values = [*rates, total, one]
    ax.bar(names, values, color=["tab:blue"] * len(labels) + ["tab:green", "tab:gray"])
    ax.set_ylabel("samples/s")
    ax.set_title("multigpu demo: throughput per device")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default=None, help="comma-separated (default: see above)")
    p.add_argument("--ratios", default="auto")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rows", type=int, default=None, help="training rows (default: all 60000)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="global batch (128: enough steps for BatchNorm's moving statistics in 2 epochs)")
    p.add_argument("--width", type=float, default=None, help="filter scale (default: 1 on GPU, 0.25 on CPU)")
    p.add_argument("--out", default="demo-output")
    a = p.parse_args()
    on_gpu = cuda_device_count() > 0
    devices, why = (a.devices.split(","), "as asked") if a.devices else default_devices()
    width = a.width or (1.0 if on_gpu else 0.25)
    rows = a.rows or 60000
    say = print if multigpu.rank() == 0 else (lambda *_: None)
    one = None
    if multigpu.rank() == 0 and multigpu.world_size() == 1 and os.environ.get("MULTIGPU_RANK") is None:
        say(f"devices: {', '.join(devices)} ({why})")
        if not on_gpu:
            say(f"on CPU: network width {width:g} (filters scaled), {rows} training rows, {a.epochs} epoch(s)")
            say("measuring one full-speed device alone for the speedup ...")
            one = one_device_rate(width, a.batch_size, [0])
    keras.utils.set_random_seed(0)
    model = convnet(width=width)
    ratios = None if a.ratios == "auto" else [float(r) for r in a.ratios.split(",")]
    model = multigpu.parallelize(model, devices=devices, ratios=ratios if ratios else "auto")
    model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    x, y, xt, yt = load_data(rows, say)
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
    shares = state.shares(a.batch_size)
    rates = [total * s / a.batch_size for s in shares]
    print(f"\n{'device':<12}{'share':>8}{'batch':>8}{'samples/s':>12}")
    for dev, s, r in zip(state.devices, shares, rates):
        print(f"{dev.label:<12}{s / a.batch_size:>8.0%}{s:>8}{r:>12.1f}")
    print(f"{'total':<12}{'100%':>8}{a.batch_size:>8}{total:>12.1f}")
    if one:
        ideal = sum(d.speed for d in state.devices)
        print(f"one full-speed device alone: {one:.1f} samples/s -> speedup {total / one:.2f}x "
              f"(the speed factors add up to {ideal:.2f}; on a CPU the smaller local batches "
              "also run faster per sample)")
    print(f"test accuracy: {acc:.4f} (loss {loss:.4f})")
    plot(out / "throughput.png", [d.label for d in state.devices], rates, total, one or float("nan"))
    print(f"saved the model to {out / 'fashion_convnet.keras'} and the plot to {out / 'throughput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
