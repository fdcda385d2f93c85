"""Training that reads its data: input pipelines on one device, on multigpu's two devices, and under DDP.

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_input.py          # ~12 min
    ... benchmarks/bench_input.py --cases pyds-io --rounds 1                                  # one case

For each input case of ``benchmarks/_input_worker.py`` (an I/O-bound and a CPU-bound
``PyDataset``, an I/O-bound and a CPU-bound ``DataLoader`` over a map-style dataset, an I/O-bound
generator, an I/O-bound and a CPU-bound ``tf.data`` pipeline, ``image_dataset_from_directory`` over
PNG files; the ``tf*`` cases need TensorFlow), one configuration after another, each in fresh
processes, in ``--rounds`` rounds (the median counts):

* ``single``: plain Keras ``fit`` on one core, the same loader and workers;
* ``mg2``: multigpu on ``cpu:0`` and ``cpu:1``, equal shares;
* ``ddp``: a hand-written DDP loop on both cores, each rank loading only its own rows
  (``DistributedSampler``) with the same costs and workers, equal shares (not for the generator,
  which cannot be sampled by index).

The cases ``pyds-io-slow`` and ``tfdata-io-slow`` put the I/O-bound ``PyDataset`` (``tf.data``
pipeline) on ``cpu:0`` and ``cpu:1@0.5`` (the
second held to half a core; needs root) with equal (``mg2-equal``) and automatic (``mg2-auto``)
shares.  Prints a table of ratios and writes ``benchmarks/input/input.json``.  Run it on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multigpu.runtime.processes import free_port  # noqa: E402

WORKER = str(ROOT / "benchmarks" / "_input_worker.py")
CASES = ["arrays-none", "pyds-io", "pyds-cpu", "loader-io", "loader-cpu", "gen-io", "pyds-io-slow",
         "tfdata-io", "tfdata-cpu", "tfdir-io", "tfdata-io-slow"]
CONFIGS = {"single": "single", "mg2": "mg2", "ddp": "ddp"}


def _env() -> dict:
    return dict(os.environ, KERAS_BACKEND=os.environ.get("KERAS_BACKEND") or "torch", OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))


def _run(commands: list[tuple[list[str], dict, object]], out: Path, timeout: float) -> dict:
    """Runs the processes together; a failure or the timeout stops them all."""
    logs = [out.with_suffix(f".log{i}") for i in range(len(commands))]
    procs = []
    for (cmd, env, pre), log in zip(commands, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=pre, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"process {failed[0]} failed" if failed else f"timed out after {timeout:.0f} s"
                raise RuntimeError(f"{why}: {commands[0][0]}\n{logs[failed[0] if failed else 0].read_text()[-3000:]}")
            time.sleep(0.1)
        failed = [i for i, p in enumerate(procs) if p.returncode]
        if failed:
            raise RuntimeError(f"process {failed[0]} failed: {commands[0][0]}\n{logs[failed[0]].read_text()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return json.loads(out.read_text())


def _pin(core: int):
    def pre():
        os.sched_setaffinity(0, {core})
    return pre


def run_config(case: str, config: str, steps: int, warmup: int, gen_wait: float, width: float) -> dict:
    """One run of ``config`` on ``case`` in fresh processes; returns rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="multigpu-bench-input-") as tmp:
        out = Path(tmp) / "result.json"
        args = ["--case", case, "--out", str(out), "--steps", str(steps), "--warmup", str(warmup),
                "--gen-wait", str(gen_wait), "--width", str(width)]
        env = _env()
        if config == "single":
            commands = [([sys.executable, WORKER, *args], env, _pin(0))]
        elif config == "ddp":
            port = free_port()
            commands = [([sys.executable, WORKER, *args, "--ddp"],
                         dict(env, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                              GLOO_SOCKET_IFNAME="lo"), None) for r in range(2)]
        else:
            devices = "cpu:0,cpu:1@0.5" if case.endswith("-slow") else "cpu:0,cpu:1"
            ratios = "auto" if config == "mg2-auto" else "1,1"
            commands = [([sys.executable, "-m", "multigpu", "run", "--devices", devices, "--ratios", ratios,
                          "--timeout", "120", WORKER, *args, "--multigpu"], env, None)]
        return _run(commands, out, timeout=900)


def configs_of(case: str) -> list[str]:
    if case.endswith("-slow"):
        return ["mg2-equal", "mg2-auto"]
    return ["single", "mg2"] if case.startswith(("gen", "arrays")) else ["single", "mg2", "ddp"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps (the -slow case takes 4 times as many)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--gen-wait", type=float, default=80.0, help="ms the generator waits per batch")
    p.add_argument("--width", type=float, default=2.0,
                   help="scales the convnet's filter counts (2: 32 and 64 filters, about 800 samples/s on one core)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "input" / "input.json"))
    a = p.parse_args()
    results = {}
    for case in a.cases.split(","):
        steps, warmup = (a.steps * 4, a.warmup * 4) if case.endswith("-slow") else (a.steps, a.warmup)
        runs: dict[str, list[dict]] = {c: [] for c in configs_of(case)}
        for round_ in range(a.rounds):
            for config, tried in runs.items():
                result = run_config(case, config, steps, warmup, a.gen_wait, a.width)
                tried.append(result)
                print(f"  {case:14s} round {round_ + 1} {config:10s} {result['samples_per_second']:8.0f} samples/s",
                      flush=True)
        results[case] = {c: dict(sorted(rs, key=lambda r: r["samples_per_second"])[(len(rs) - 1) // 2],
                                 rounds=[r["samples_per_second"] for r in rs]) for c, rs in runs.items()}
    print("\n| case | single | mg2 | ddp | mg2 / single | mg2 / ddp | input wait (mg2, per device) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for case, r in results.items():
        if case.endswith("-slow"):
            continue
        rate = {c: r[c]["samples_per_second"] for c in r}
        ddp = rate.get("ddp")
        waits = "/".join(f"{w:.0%}" for w in (r["mg2"].get("input_share") or []))
        versus_ddp = f"{rate['mg2'] / ddp:.2f}x" if ddp else "-"
        print(f"| {case} | {rate['single']:.0f} | {rate['mg2']:.0f} | {f'{ddp:.0f}' if ddp else '-'} | "
              f"{rate['mg2'] / rate['single']:.2f}x | {versus_ddp} | {waits} |")
    for case, r in results.items():
        if case.endswith("-slow"):
            eq, auto = r["mg2-equal"]["samples_per_second"], r["mg2-auto"]["samples_per_second"]
            print(f"\n{case} (cpu:0 + cpu:1@0.5): equal {eq:.0f}, auto {auto:.0f} samples/s "
                  f"(shares {r['mg2-auto'].get('shares')}): auto / equal {auto / eq:.2f}x")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "cpus": os.cpu_count(),
            "command": " ".join(["benchmarks/bench_input.py", *sys.argv[1:]]), "gen_wait_ms": a.gen_wait,
            "width": a.width}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
