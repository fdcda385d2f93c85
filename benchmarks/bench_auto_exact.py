"""Automatic shares stay exact: fresh runs with ``ratios="auto"``, each one's weights against one device's.

    KERAS_BACKEND=tensorflow OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_auto_exact.py --runs 20
    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_auto_exact.py --runs 20

The benchmark MLP (``multigpu.bench.models``'s ``mlp`` at width 0.5, SGD) trains at a global batch of 64
for ``--epochs`` epochs of ``--steps`` steps, in the same data order (no shuffling), first on one device
(plain Keras, one process), then ``--runs`` times as a plain ``python script.py`` on ``cpu:0`` and
``cpu:1`` with ``ratios="auto"`` from a fresh profile: calibration, then the share search, moving the
local batch sizes from step to step.  Every run's weights are compared with the one device's (the
largest difference over the largest weight); the promise is 1e-5.  Prints each run's difference and
settled shares, and the largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")


def train(out: str, devices: str, profile: str, epochs: int, steps: int, batch: int) -> None:
    """One run (a rank of it, when ``devices`` names several): writes rank 0's weights and shares to ``out``."""
    import keras
    import numpy as np

    from multigpu.bench.models import get_model

    spec = get_model("mlp")
    keras.utils.set_random_seed(0)
    model = spec.build(0.5)
    spec.compile(model)
    x, y = spec.data(batch * steps, 0)
    shares = [1.0]
    if devices != "one":
        import multigpu

        model = multigpu.parallelize(model, devices=devices.split(","), ratios="auto", profile=profile)
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    if devices != "one":
        if multigpu.rank() != 0:
            return
        shares = multigpu.state(model).ratios
    np.save(out, np.concatenate([np.ravel(w) for w in model.get_weights()]))
    Path(out + ".json").write_text(json.dumps({"shares": list(shares)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--devices", default="cpu:0,cpu:1")
    args = parser.parse_args()
    import numpy as np

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory(prefix="bench-auto-exact-") as tmp:
        def run(name: str, devices: str) -> tuple[np.ndarray, list]:
            out = str(Path(tmp) / f"{name}.npy")
            cmd = [sys.executable, __file__, "--train", out, devices, str(Path(tmp) / f"{name}.profile.json"),
                   str(args.epochs), str(args.steps), str(args.batch)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"run {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            return np.load(out), json.loads(Path(out + ".json").read_text())["shares"]

        one, _ = run("one", "one")
        scale = float(np.max(np.abs(one)))
        worst = 0.0
        print(f"{os.environ['KERAS_BACKEND']}: {args.runs} fresh runs with automatic shares on {args.devices}, "
              f"{args.epochs} epochs of {args.steps} steps at batch {args.batch}, against one device", flush=True)
        for k in range(args.runs):
            weights, shares = run(f"auto{k}", args.devices)
            diff = float(np.max(np.abs(weights - one))) / scale
            worst = max(worst, diff)
            print(f"run {k + 1:2d}: {diff:.1e} of the largest weight, shares "
                  f"{'/'.join(f'{s / sum(shares):.0%}' for s in shares)}", flush=True)
        print(f"largest difference: {worst:.1e} ({'within' if worst <= 1e-5 else 'NOT within'} 1e-5)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--train":
        out, devices, profile, epochs, steps, batch = sys.argv[2:8]
        train(out, devices, profile, int(epochs), int(steps), int(batch))
    else:
        main()
