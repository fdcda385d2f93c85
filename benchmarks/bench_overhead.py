"""Speed where communication and per-step overhead dominate, and where each millisecond of a step goes.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_overhead.py          # ~15 min
    ... benchmarks/bench_overhead.py --cases mlp:0.5:64 --steps-scale 0.5                         # one case
    ... benchmarks/bench_overhead.py --suite transformers     # keras-hub BERT and GPT-2 at batch 64 and 256
    ... benchmarks/bench_overhead.py --suite applications     # keras.applications models at batch 64
    KERAS_BACKEND=tensorflow ... benchmarks/bench_overhead.py --suite tensorflow   # against MirroredStrategy
    ... benchmarks/bench_overhead.py --cases mlp:0.5:64:80 --configs single,mg2 --backends torch,tensorflow
        # backends side by side: each round runs every configuration on each backend in turn

For each case (model:width:global batch), one after another, each configuration in fresh
processes (``multigpu.bench.runs.run_config``), devices ``cpu:0`` and ``cpu:1`` (one core each), in
``--rounds`` rounds (3: the median run of each configuration counts, since one run on this shared
machine can be off by 10-30%):

* ``single``: plain Keras ``model.fit`` on one core (no multigpu);
* ``mg1``: the same through ``multigpu.parallelize(model, devices=["cpu:0"])``;
* ``mg2``: multigpu on both devices, equal shares (exact mode, shared-memory transport);
* ``mg2-keras`` (only when asked for): ``mg2`` with Keras's own forward pass (``MULTIGPU_REPLAY=0``), to
  measure what replaying it (``multigpu.backend.torch.replay``) buys;
* ``ddp``: a hand-written PyTorch DDP loop driving the same Keras model, equal shares;
* ``keras-ddp``: Keras's own ``fit`` with the model wrapped in DDP (what Keras's next release does);
* ``tf-mirrored`` (``KERAS_BACKEND=tensorflow``, the ``tensorflow`` suite's baseline in place of the two DDP
  loops): Keras's own ``fit`` under ``tf.distribute.MirroredStrategy``, one process on both cores, one logical
  CPU device per core, equal halves of every batch.

On torch and TensorFlow, ``single``, ``mg1`` and ``mg2`` carry phase timers (``multigpu.bench.breakdown``;
on TensorFlow the step is one traced function, whose forward pass, loss, backward pass, update and metrics
are its "rest of the step", beside the host sum of its gradients and, with the optimizer state in parts,
the new weights' exchange under "optimizer"): milliseconds
per step in the forward pass, the loss, ``backward``, summing gradients over ranks, the optimizer
update, the metrics, the rest of the training step (multigpu's hooks and Keras's step code) and
Keras's loop outside the step (data, callbacks).  Results: printed tables, and
``benchmarks/overhead/overhead.json``.  Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multigpu.bench.breakdown import PHASES  # noqa: E402
from multigpu.bench.runs import run_config  # noqa: E402

# model, width, global batch, timed steps (the table, plus gru and convnet)
CASES = ["mlp:0.5:64:80", "mlp:0.5:512:30", "dense41m:1:256:8", "gru:1:64:40", "convnet:0.25:256:12"]
SUITES = {
    "default": CASES,
    # small keras-hub backbones (2 layers, hidden 64, 32 tokens) built from a config
    "transformers": ["bert:1:64:60", "bert:1:256:24", "gpt2:1:64:60", "gpt2:1:256:24"],
    # keras.applications, weights=None, 32x32x3 images
    "applications": ["mobilenetv3small:1:64:20", "efficientnetb0:1:64:10", "resnet50:1:64:6"],
    # KERAS_BACKEND=tensorflow: the convnet and the MLP at batch 64, against MirroredStrategy
    "tensorflow": ["convnet:0.25:256:12", "mlp:0.5:64:80", "mlp:0.5:512:30"],
}
CONFIGS = {
    "single": {"mode": "single", "devices": ["cpu:0"], "cores": [0], "breakdown": True},
    "mg1": {"mode": "solo", "devices": ["cpu:0"], "cores": [0], "breakdown": True},
    "mg2": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "breakdown": True},
    "mg2-parts": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "breakdown": True,
                  "shard_optimizer": True},
    "mg2-whole": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "breakdown": True,
                  "shard_optimizer": False},
    "mg2-keras": {"mode": "multigpu", "devices": ["cpu:0", "cpu:1"], "ratios": [1, 1], "breakdown": True,
                  "env": {"MULTIGPU_REPLAY": "0"}},
    "ddp": {"mode": "ddp", "devices": ["cpu:0", "cpu:1"]},
    "keras-ddp": {"mode": "keras-ddp", "devices": ["cpu:0", "cpu:1"]},
    "tf-mirrored": {"mode": "tf-mirrored", "devices": ["cpu:0", "cpu:1"]},
}

DEFAULT_CONFIGS = ["single", "mg1", "mg2", "ddp", "keras-ddp"]
TENSORFLOW_CONFIGS = ["single", "mg1", "mg2", "tf-mirrored"]
BASELINE_NAMES = ("ddp", "keras-ddp", "tf-mirrored")


def run_case(case: str, steps_scale: float, configs: list[str], rounds: int, breakdown: bool = True,
             backends: list[str] | None = None) -> dict:
    """Every configuration ``rounds`` times, one after another in each round; the median rate of each.  With
    ``backends``, each configuration runs on each of them in every round (named ``config@backend``)."""
    model, width, batch, steps = case.split(":")
    out = {"model": model, "width": float(width), "batch": int(batch), "runs": {}}
    names = [f"{c}@{b}" for b in backends for c in configs] if backends else configs
    tried: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names:
            config, _, backend = name.partition("@")
            cfg = dict(CONFIGS[config], model=model, width=float(width), batch=int(batch),
                       steps=max(4, round(int(steps) * steps_scale)), warmup=3, seed=0)
            if backend:
                cfg["env"] = {**cfg.get("env", {}), "KERAS_BACKEND": backend}
            if not breakdown:
                cfg.pop("breakdown", None)
            t0 = time.monotonic()
            result = run_config(cfg, timeout=900, stream=False)
            tried[name].append({"samples_per_second": result["samples_per_second"],
                                "breakdown": result.get("breakdown"), "seconds": time.monotonic() - t0})
            print(f"  {case:22s} round {round_ + 1} {name:10s} {result['samples_per_second']:9.1f} samples/s",
                  flush=True)
    for name, runs in tried.items():
        median = sorted(runs, key=lambda r: r["samples_per_second"])[(len(runs) - 1) // 2]
        out["runs"][name] = dict(median, rounds=[r["samples_per_second"] for r in runs])
    return out


def ratio_table(results: list[dict], configs: list[str]) -> str:
    """mg2 over one device and over every baseline that ran, and mg1 over one device."""
    baselines = [b for b in BASELINE_NAMES if b in configs]
    lines = ["| model | batch | mg2 / single | " + "".join(f"mg2 / {b} | " for b in baselines) + "mg1 / single "
             "| samples/s single, mg2, " + ", ".join(baselines) + " |",
             "|---|---:|---:|" + "---:|" * len(baselines) + "---:|---|"]
    for r in results:
        s = {k: v["samples_per_second"] for k, v in r["runs"].items()}
        lines.append(f"| {r['model']} (width {r['width']:g}) | {r['batch']} | {s['mg2'] / s['single']:.2f}x | "
                     + "".join(f"{s['mg2'] / s[b]:.2f}x | " for b in baselines)
                     + f"{s['mg1'] / s['single']:.2f}x | "
                     + ", ".join(f"{s[k]:.0f}" for k in ("single", "mg2", *baselines)) + " |")
    return "\n".join(lines)


def backends_table(results: list[dict], backends: list[str]) -> str:
    """mg2 over one device on each backend, measured in the same rounds."""
    lines = ["| model | batch | " + " | ".join(f"{b}: mg2 / single (samples/s)" for b in backends) + " |",
             "|---|---:|" + "---:|" * len(backends)]
    for r in results:
        s = {k: v["samples_per_second"] for k, v in r["runs"].items()}
        lines.append(f"| {r['model']} (width {r['width']:g}) | {r['batch']} | " + " | ".join(
            f"{s[f'mg2@{b}'] / s[f'single@{b}']:.2f}x ({s[f'mg2@{b}']:.0f} / {s[f'single@{b}']:.0f})"
            for b in backends) + " |")
    return "\n".join(lines)


def breakdown_table(results: list[dict]) -> str:
    columns = [*PHASES, "rest of the step", "Keras loop, data, callbacks", "wall"]
    lines = ["| model, batch | run | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
    for r in results:
        for name, run in r["runs"].items():
            b = run.get("breakdown")
            if b:
                lines.append(f"| {r['model']} {r['batch']} | {name} | " + " | ".join(f"{b[c]:.2f}" for c in columns)
                             + " |")
    return "\n".join(lines)


def replay_table(results: list[dict]) -> str:
    lines = ["| model | batch | mg2 / mg2-keras (replayed forward pass / Keras's own) | samples/s mg2, mg2-keras |",
             "|---|---:|---:|---|"]
    for r in results:
        s = {k: v["samples_per_second"] for k, v in r["runs"].items()}
        lines.append(f"| {r['model']} (width {r['width']:g}) | {r['batch']} | {s['mg2'] / s['mg2-keras']:.2f}x | "
                     f"{s['mg2']:.0f}, {s['mg2-keras']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=None, help="model:width:batch[:steps] (default: the suite's)")
    p.add_argument("--suite", default="default", choices=sorted(SUITES), help="a named set of cases")
    p.add_argument("--configs", default=None,
                   help="comma-separated, of " + ",".join(CONFIGS) + " (default: " + ",".join(DEFAULT_CONFIGS)
                   + "; on TensorFlow " + ",".join(TENSORFLOW_CONFIGS) + ")")
    p.add_argument("--steps-scale", type=float, default=1.0, help="multiply every case's timed steps")
    p.add_argument("--backends", default=None,
                   help="comma-separated Keras backends to run every configuration on, side by side")
    p.add_argument("--rounds", type=int, default=3, help="runs of every configuration; the median counts")
    p.add_argument("--no-breakdown", action="store_true",
                   help="no phase timers (they cost single, mg1 and mg2 a little, and the baselines nothing)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "overhead" / "overhead.json"))
    a = p.parse_args()
    tensorflow = os.environ.get("KERAS_BACKEND") == "tensorflow"
    configs = (a.configs or ",".join(TENSORFLOW_CONFIGS if tensorflow else DEFAULT_CONFIGS)).split(",")
    breakdown = not a.no_breakdown and os.environ.get("KERAS_BACKEND", "torch") in ("torch", "tensorflow")
    start = time.monotonic()
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    cases = a.cases or SUITES[a.suite]
    backends = a.backends.split(",") if a.backends else None
    if backends:
        breakdown = False  # the tables below read plain configuration names
    results = [run_case(c if c.count(":") == 3 else c + ":30", a.steps_scale, configs, a.rounds, breakdown,
                        backends) for c in cases]
    if backends and {"single", "mg2"} <= set(configs):
        print("\n" + backends_table(results, backends))
    elif {"single", "mg1", "mg2"} <= set(configs):
        print("\n" + ratio_table(results, configs))
    if not backends and {"mg2", "mg2-keras"} <= set(configs):
        print("\n" + replay_table(results))
    if breakdown:
        print("\nmilliseconds per step (rank 0):\n" + breakdown_table(results))
    print(f"\n{(time.monotonic() - start) / 60:.1f} min on {platform.node()}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": sys.argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
