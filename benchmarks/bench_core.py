"""Core benchmark: multigpu's overhead, 2-device scaling and memory, side by side.

Runs three configurations of the Keras multi-GPU MNIST convnet
(:func:`benchmarks.models.convnet`) on synthetic 28x28x1 data with 10 classes,
one after another, each in its own process (``benchmarks/_worker.py``):

* ``plain``: Keras ``model.fit`` without multigpu, pinned to one core, one thread;
* ``mg1``: ``multigpu.parallelize(model, devices=["cpu:0"])`` in a process
  whose affinity is one core (a lone CPU device would otherwise take every
  usable core, see ``multigpu.devices.assign_cores``);
* ``mg2``: ``devices=["cpu:0", "cpu:1"]`` with equal ratios, one core each.

Throughput is steady-state global samples/s (the first ``--warmup`` steps are
not timed); memory is each rank's peak resident set (VmHWM); cpu/wall is CPU
time over wall time during the timed steps (under 1.0 when other processes
compete for the core or, in mg2, while a rank waits for the other).  It prints
a table and the ratios against their targets, and writes them as JSON:

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 python benchmarks/bench_core.py          # full size
    KERAS_BACKEND=torch OMP_NUM_THREADS=1 python benchmarks/bench_core.py --quick  # ~30 s check

Targets: mg1/plain throughput >= 0.97; mg2/mg1 throughput >= 1.9; every
rank's peak RSS <= 1.1x plain's.  Needs at least 2 usable cores for ``mg2``;
run it on an otherwise idle machine, since the ratios compare wall-clock times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "benchmarks" / "_worker.py"
RESULTS = ROOT / "benchmarks" / "core"
Result = dict[str, Any]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="narrow net (width 0.125), batch 32, 10 steps: checks the script in ~30 s")
    p.add_argument("--batch", type=int, default=None, help="global batch size (default 256; quick 32)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per configuration (default 20; quick 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps per configuration (>= 1)")
    p.add_argument("--width", type=float, default=None,
                   help="convnet filter width factor (default 1.0; quick 0.125)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the configurations round-robin this many times and keep each one's best")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one configuration may take")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default benchmarks/core/core.json; quick: core-quick.json)")
    a = p.parse_args(argv)
    a.batch = a.batch or (32 if a.quick else 256)
    a.steps = a.steps or (10 if a.quick else 20)
    a.width = a.width or (0.125 if a.quick else 1.0)
    a.out = a.out or RESULTS / ("core-quick.json" if a.quick else "core.json")
    if min(a.batch, a.steps, a.warmup, a.repeats) < 1:
        p.error("--batch, --steps, --warmup and --repeats must be at least 1")
    return a


def command_line() -> str:
    """The command that started this run, with the environment it depends on."""
    env = [f"{k}={os.environ[k]}" for k in ("KERAS_BACKEND", "OMP_NUM_THREADS") if k in os.environ]
    return shlex.join([*env, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])])


def configurations(cores: list[int]) -> list[tuple[str, list[int], str | None]]:
    """(name, cores, devices) of each configuration, in run order."""
    configs: list[tuple[str, list[int], str | None]] = [
        ("plain", cores[:1], None),
        ("mg1", cores[:1], "cpu:0"),
    ]
    if len(cores) >= 2:
        configs.append(("mg2", cores[:2], "cpu:0,cpu:1"))
    else:
        print(f"only {len(cores)} usable core(s): skipping the 2-device configuration", file=sys.stderr)
    return configs


def run_worker(name: str, cores: list[int], devices: str | None, a: argparse.Namespace,
               tmp: Path) -> list[Result]:
    """Runs one configuration in a fresh process; returns one result per rank."""
    prefix = tmp / name
    for old in tmp.glob(f"{name}.rank*.json"):
        old.unlink()
    cmd = [sys.executable, str(WORKER), "--prefix", str(prefix), "--cores", ",".join(map(str, cores)),
           "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--width", str(a.width)]
    if devices:
        cmd += ["--devices", devices]
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    print(f"  running {name:<6} cores={cores} devices={devices or '(plain keras)'} ...", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout,
                          check=False)
    ranks = sorted(tmp.glob(f"{name}.rank*.json"))
    expected = len(devices.split(",")) if devices else 1
    if proc.returncode or len(ranks) != expected:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"configuration {name} failed (exit code {proc.returncode}, "
                         f"{len(ranks)}/{expected} rank results): {shlex.join(cmd)}")
    results = [json.loads(r.read_text()) for r in ranks]
    return sorted(results, key=lambda r: r["rank"])


def summarize(best: dict[str, list[Result]]) -> list[dict[str, Any]]:
    """The three checks: measured ratio, target, and whether it is met."""
    def speed(name: str) -> float:
        return best[name][0]["samples_per_s"]

    checks = []
    if "mg1" in best:
        checks.append({"check": "throughput mg1 / plain", "ratio": speed("mg1") / speed("plain"),
                       "target": ">= 0.97", "ok": speed("mg1") / speed("plain") >= 0.97})
    if "mg1" in best and "mg2" in best:
        checks.append({"check": "throughput mg2 / mg1", "ratio": speed("mg2") / speed("mg1"),
                       "target": ">= 1.9", "ok": speed("mg2") / speed("mg1") >= 1.9})
    plain_rss = best["plain"][0]["peak_rss_mb"]
    for name in ("mg1", "mg2"):
        for r in best.get(name, []):
            ratio = r["peak_rss_mb"] / plain_rss
            checks.append({"check": f"peak RSS {name} rank {r['rank']} / plain", "ratio": ratio,
                           "target": "<= 1.1", "ok": ratio <= 1.1})
    return checks


def print_report(best: dict[str, list[Result]], checks: list[dict[str, Any]]) -> None:
    print(f"\n{'config':<7} {'devices':<12} {'rank':>4} {'cores':<6} {'step ms':>9} "
          f"{'samples/s':>10} {'cpu/wall':>8} {'peak RSS MiB':>13}")
    for name, ranks in best.items():
        for r in ranks:
            cores = ",".join(map(str, r["cores"]))
            print(f"{name:<7} {r['devices'] or 'plain':<12} {r['rank']:>4} {cores:<6} "
                  f"{r['step_s'] * 1e3:>9.1f} {r['samples_per_s']:>10.1f} {r['cpu_per_wall']:>8.2f} "
                  f"{r['peak_rss_mb']:>13.1f}")
    print(f"\n{'check':<32} {'ratio':>7}  {'target':<8} result")
    for c in checks:
        print(f"{c['check']:<32} {c['ratio']:>7.3f}  {c['target']:<8} {'ok' if c['ok'] else 'MISSED'}")
    busy = [name for name in ("plain", "mg1") if name in best and best[name][0]["cpu_per_wall"] < 0.9]
    if busy:
        print(f"warning: {', '.join(busy)} got under 90% of a core (cpu/wall): other processes were "
              "competing for the cores, so the throughput ratios are unreliable; rerun on an idle "
              "machine or with --repeats 3")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cmd = command_line()
    print(f"command: {cmd}")
    cores = sorted(os.sched_getaffinity(0))
    print(f"convnet width {a.width:g}, global batch {a.batch}, {a.steps} timed steps after "
          f"{a.warmup} warm-up, {a.repeats} repeat(s), usable cores {cores}")
    if a.quick:
        print("quick mode: a tiny net, where fixed per-step costs dominate; the ratios are not meaningful")
    configs = configurations(cores)
    best: dict[str, list[Result]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_core_") as tmp:
        for rep in range(a.repeats):
            if a.repeats > 1:
                print(f"repeat {rep + 1}/{a.repeats}")
            for name, cfg_cores, devices in configs:
                ranks = run_worker(name, cfg_cores, devices, a, Path(tmp))
                if name not in best or ranks[0]["samples_per_s"] > best[name][0]["samples_per_s"]:
                    best[name] = ranks
    checks = summarize(best)
    print_report(best, checks)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": cmd,
        "settings": {"model": "convnet", "width": a.width, "batch": a.batch, "steps": a.steps,
                     "warmup": a.warmup, "repeats": a.repeats, "quick": a.quick},
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpu_count": os.cpu_count(), "usable_cores": cores},
        "results": best,
        "checks": checks,
    }
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
