"""Memory soak: resident memory of each rank over many epochs on 2 devices.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 python benchmarks/bench_soak.py [--epochs 30] [--quick]

Trains a small convnet for ``--epochs`` epochs on two CPU devices (fit is
called once per epoch, as scripts that loop over epochs do, plus evaluate and
predict each time) and records each rank's resident set size after every
epoch.  Target: each rank's memory grows by less than 5% after the first
epoch.  Writes ``benchmarks/soak/soak.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(epochs: int, rows: int, out: str) -> None:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras
    import numpy as np

    import multigpu
    from multigpu.bench.models import convnet

    keras.utils.set_random_seed(0)
    model = multigpu.parallelize(convnet(width=0.125), devices=["cpu:0", "cpu:1"], ratios=[3, 1])
    model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 28, 28, 1)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, rows)]
    samples = []
    for _ in range(epochs):
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        model.evaluate(x[:256], y[:256], batch_size=64, verbose=0)
        model.predict(x[:256], batch_size=64, verbose=0)
        samples.append(rss_bytes())
    Path(f"{out}.rank{multigpu.rank()}.json").write_text(json.dumps(samples))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="5 epochs of 512 rows")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.epochs, a.rows = 5, 512
    if a.worker:
        worker(a.epochs, a.rows, a.worker)
        return 0
    import subprocess
    import tempfile

    print("command: KERAS_BACKEND=torch OMP_NUM_THREADS=1 python " + " ".join(sys.argv))
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "soak")
        env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, __file__, "--epochs", str(a.epochs), "--rows", str(a.rows),
                        "--worker", prefix], check=True, env=env)
        ranks = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(2)]
    result = {"epochs": a.epochs, "rows": a.rows, "ranks": []}
    print(f"{'rank':>4} {'after epoch 1 MiB':>18} {'after last MiB':>15} {'growth':>8}")
    for r, samples in enumerate(ranks):
        growth = samples[-1] / samples[0] - 1
        result["ranks"].append({"rss_bytes": samples, "growth_after_first_epoch": growth})
        print(f"{r:>4} {samples[0] / 2**20:>18.1f} {samples[-1] / 2**20:>15.1f} {growth:>8.2%}")
    worst = max(x["growth_after_first_epoch"] for x in result["ranks"])
    print(f"largest growth after the first epoch: {worst:.2%} (target < 5%): {'ok' if worst < 0.05 else 'MISSED'}")
    name = "soak-quick.json" if a.quick else "soak.json"
    out = ROOT / "benchmarks" / "soak" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
