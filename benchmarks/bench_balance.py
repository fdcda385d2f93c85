"""Balance benchmark: shares for devices of different speeds, side by side in one run.

Trains the Keras multi-GPU MNIST convnet (:func:`benchmarks.models.convnet`)
on synthetic 28x28x1 data, global batch 256, with a fast device ``cpu:0`` and
a slow one ``cpu:1@0.5`` (half a core, by a cgroup CPU quota: needs root).
Every configuration runs in its own process (``benchmarks/_balance_worker.py``),
one after another:

1. **solo**: each device alone (``parallelize(model, devices=["cpu:0"])``
   pinned to core 0; ``devices=["cpu:0@0.5"]`` pinned to core 1) at the local
   batch it gets in a balanced run (171 and 85), steady-state samples/s;
2. **balance efficiency** = 2-device samples/s / (solo fast + solo slow) for
   equal shares (``ratios=[1, 1]``, ``rebalance=False``), for
   ``ratios="auto"`` (default rebalancing, ``recalibrate=True`` and a fresh
   profile file) and for a grid of fixed shares of device 0 (0.55 ... 0.75,
   ``rebalance=False``).  Only steps after the warm-up are timed (``auto``:
   after the calibration step and two more);
3. **mid-run slowdown**: ``devices=["cpu:0", "cpu:1"]``, ``ratios="auto"``;
   rank 1 puts itself under ``CpuQuota(1.0, 1)`` and switches it to 0.5 at the
   end of step ``--slowdown-step``.  It reports how many steps after the
   change the rolling throughput (``--window`` steps) takes to reach 0.9 of
   the new balanced ideal (solo fast + solo slow), and the steps at which
   multigpu moved the shares (its ``multigpu: shares ...`` lines).

It prints the command line, a table, the checks against their targets, writes
JSON and draws a PNG (bars of throughput per configuration; rolling throughput
and device 0's share against step in the slowdown run)::

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_balance.py          # full size
    KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_balance.py --quick  # ~75 s check

The full run (width 1.0, 8 timed steps per configuration, slowdown after step
10 and 50 steps after it) takes about 10-11 minutes on the idle 2-core
development machine (~4.6 s per 256-sample step on one core); it prints its
own estimate once the solo runs have measured the speeds.  Results:
``benchmarks/results/balance.json`` and ``balance.png`` (``--quick``:
``balance-quick.json`` and ``balance-quick.png``, git-ignored).

Targets: auto efficiency >= 0.95; auto / best grid point >= 0.97; equal
shares near their theoretical efficiency (about 0.67); the slowdown recovered
within 50 steps.  The ratios compare wall-clock times: run it on an otherwise
idle machine.  The ``other load`` column is the CPU that other processes took
from the cores in use during the timed steps (from ``/proc/stat``); above 0.05
core the numbers are disturbed, and the script says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from multigpu.planning import split  # noqa: E402  (pure Python: imports neither torch nor Keras)

WORKER = ROOT / "benchmarks" / "_balance_worker.py"
RESULTS = ROOT / "benchmarks" / "results"
FAST, SLOW, SLOW_FRACTION = "cpu:0", "cpu:1@0.5", 0.5
GRID = (0.55, 0.60, 0.65, 0.70, 0.75)
QUICK_GRID = (0.60, 0.70)
STARTUP_S = 10.0  # a first guess of one configuration's start-up (imports, process start, gloo)
Result = dict[str, Any]


@dataclass
class Config:
    """One configuration: one worker process (and the ranks it starts)."""

    name: str
    devices: str
    cores: str
    batch: int
    steps: int  # steps run, one epoch
    skip: int  # untimed first steps
    ratios: str | None = None  # "auto", "0.6,0.4" or None
    rebalance: str = "default"  # "on", "off" or "default"
    share0: float | None = None  # device 0's fixed share, for the prediction
    slowdown_step: int | None = None

    @property
    def world_size(self) -> int:
        return len(self.devices.split(","))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="width 0.25, 4 timed steps, grid 0.60/0.70, slowdown after step 6 then 24 steps: ~75 s")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per throughput configuration (default 8; quick 4)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed first steps of the fixed-share and solo runs (auto: one more) (>= 1)")
    p.add_argument("--width", type=float, default=None, help="convnet filter width factor (default 1.0; quick 0.25)")
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--grid", default=None,
                   help="comma-separated shares of device 0 for the fixed-share runs "
                        "(default 0.55,0.60,0.65,0.70,0.75; quick 0.60,0.70)")
    p.add_argument("--slowdown-step", type=int, default=None,
                   help="the slowdown happens after this step (default 10; quick 6)")
    p.add_argument("--after", type=int, default=None,
                   help="steps run after the slowdown (default 50; quick 24)")
    p.add_argument("--window", type=int, default=5, help="steps in the rolling throughput of the slowdown run")
    p.add_argument("--timeout", type=float, default=900, help="seconds one configuration may take")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output; the PNG goes next to it (default benchmarks/results/balance.json; "
                        "quick: balance-quick.json)")
    a = p.parse_args(argv)
    a.steps = a.steps or (4 if a.quick else 8)
    a.width = a.width or (0.25 if a.quick else 1.0)
    a.slowdown_step = a.slowdown_step or (6 if a.quick else 10)
    a.after = a.after or (24 if a.quick else 50)
    a.grid = [float(g) for g in a.grid.split(",")] if a.grid else list(QUICK_GRID if a.quick else GRID)
    a.out = a.out or RESULTS / ("balance-quick.json" if a.quick else "balance.json")
    if min(a.steps, a.warmup, a.slowdown_step, a.after, a.window) < 1 or a.batch < 2:
        p.error("--steps, --warmup, --slowdown-step, --after and --window must be at least 1, --batch at least 2")
    if a.window > a.after:
        p.error("--window must not exceed --after")
    if not all(0 < g < 1 for g in a.grid):
        p.error("--grid shares must lie strictly between 0 and 1")
    return a


def command_line() -> str:
    """The command that started this run, with the environment it depends on."""
    env = [f"{k}={os.environ[k]}" for k in ("KERAS_BACKEND", "OMP_NUM_THREADS") if k in os.environ]
    return shlex.join([*env, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])])


def configurations(a: argparse.Namespace) -> list[Config]:
    """Every configuration, in run order."""
    fast_local, slow_local = split(a.batch, [1.0, SLOW_FRACTION])
    pair = f"{FAST},{SLOW}"
    timed = a.warmup + a.steps
    configs = [
        Config("solo fast", "cpu:0", "0", fast_local, timed, a.warmup),
        Config("solo slow", f"cpu:0@{SLOW_FRACTION:g}", "1", slow_local, timed, a.warmup),
        Config("equal", pair, "0,1", a.batch, timed, a.warmup, "1,1", "off", 0.5),
        Config("auto", pair, "0,1", a.batch, timed + 1, a.warmup + 1, "auto"),
    ]
    configs += [Config(f"grid {g:.2f}", pair, "0,1", a.batch, timed, a.warmup, f"{g:g},{1 - g:g}", "off", g)
                for g in a.grid]
    configs.append(Config("slowdown", f"{FAST},cpu:1", "0,1", a.batch, a.slowdown_step + a.after,
                          min(3, a.slowdown_step), "auto", slowdown_step=a.slowdown_step))
    return configs


def run_worker(cfg: Config, a: argparse.Namespace, tmp: Path) -> tuple[list[Result], list[dict[str, Any]], float]:
    """Runs one configuration in a fresh process.

    Returns:
        One result per rank, the ``multigpu:`` lines about shares with the
        step they were printed in, and the process's wall time.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", cfg.name)
    prefix = tmp / slug
    cmd = [sys.executable, str(WORKER), "--prefix", str(prefix), "--cores", cfg.cores, "--devices", cfg.devices,
           "--width", f"{a.width:g}", "--batch", str(cfg.batch), "--steps", str(cfg.steps)]
    if cfg.ratios:
        cmd += ["--ratios", cfg.ratios, "--rebalance", cfg.rebalance]
    if cfg.ratios == "auto":
        cmd += ["--profile", str(tmp / f"{slug}.profile.json")]
    if cfg.slowdown_step is not None:
        cmd += ["--slowdown-step", str(cfg.slowdown_step), "--slowdown-fraction", f"{SLOW_FRACTION:g}"]
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    print(f"  running {cfg.name:<10} devices={cfg.devices:<18} batch={cfg.batch:<4} steps={cfg.steps:<3} "
          f"ratios={cfg.ratios or '-'} ...", end="", flush=True)
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout, check=False)
    wall = time.perf_counter() - began
    print(f" {wall:.0f} s", flush=True)
    paths = sorted(tmp.glob(f"{slug}.rank*.json"))
    if proc.returncode or len(paths) != cfg.world_size:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"configuration {cfg.name!r} failed (exit code {proc.returncode}, "
                         f"{len(paths)}/{cfg.world_size} rank results): {shlex.join(cmd)}")
    ranks = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["rank"])
    return ranks, share_lines(proc.stdout), wall


def share_lines(stdout: str) -> list[dict[str, Any]]:
    """multigpu's lines about shares, each with the step during which it was printed."""
    events, done = [], 0
    for line in stdout.splitlines():
        marker = re.fullmatch(r"bench-step (\d+)", line.strip())
        if marker:
            done = int(marker.group(1))
        elif line.startswith("multigpu:") and "shares" in line:
            events.append({"step": done + 1, "line": line.strip()})
    return events


def other_load(ranks: list[Result], first: int, last: int) -> float:
    """Cores' worth of CPU that other processes used on this run's cores between two step ends."""
    busy = ranks[0]["busy"]
    wall = ranks[0]["ends"][last] - ranks[0]["ends"][first]
    worst = 0.0
    for r in ranks:
        for core in r["cores"]:
            if core < len(busy[first]):
                used = busy[last][core] - busy[first][core]
                ours = r["cpu"][last] - r["cpu"][first]
                worst = max(worst, (used - ours) / wall)
    return worst


def measure(cfg: Config, ranks: list[Result]) -> Result:
    """Steady-state throughput of a configuration from rank 0's step ends."""
    ends = ranks[0]["ends"]
    first = cfg.skip - 1
    step_s = (ends[-1] - ends[first]) / (len(ends) - 1 - first)
    shares = ranks[0]["shares"][-1]
    return {
        "name": cfg.name, "devices": cfg.devices, "ratios": cfg.ratios, "rebalance": cfg.rebalance,
        "batch": cfg.batch, "steps": cfg.steps, "untimed_steps": cfg.skip,
        "local_batches": [r["local_batch"] for r in ranks],
        "share0": shares[0], "step_s": step_s, "samples_per_s": cfg.batch / step_s,
        "cpu_per_wall": [(r["cpu"][-1] - r["cpu"][first]) / (ends[-1] - ends[first]) for r in ranks],
        "other_load": other_load(ranks, first, len(ends) - 1),
        "speeds": ranks[0]["speeds"], "rebalance_changes": ranks[0]["rebalance_changes"],
        "step_ends": [e - ranks[0]["begin"] for e in ends],
        "shares_per_step": [s[0] for s in ranks[0]["shares"]],
    }


def predicted_efficiency(share0: float, batch: int, solo: tuple[float, float]) -> float:
    """Efficiency of fixed shares if each device ran at its solo speed and nothing else cost time."""
    b0, b1 = split(batch, [share0, 1 - share0])
    step = max(b0 / solo[0], b1 / solo[1])
    return batch / step / sum(solo)


def estimate_remaining(configs: list[Config], solo: tuple[float, float], solo_startup: float, batch: int) -> float:
    """Seconds the configurations after the solo runs should take, from the solo speeds.

    ``solo_startup`` is a solo run's time outside its training loop; a 2-device
    run starts its second process only once the first has built the model, so
    it takes about twice that.
    """
    startup = 2 * solo_startup
    balanced = batch / sum(solo)
    calibration = 4 * (batch / 2) / solo[1]  # 1 + 3 solo passes on half the batch, slow device
    total = 0.0
    for cfg in configs:
        if cfg.slowdown_step is not None:
            before = batch / (2 * solo[0])
            total += startup + 4 * before + cfg.slowdown_step * before + (cfg.steps - cfg.slowdown_step) * balanced
        elif cfg.ratios == "auto":
            total += startup + calibration + cfg.steps * balanced
        else:
            share = cfg.share0 if cfg.share0 is not None else 0.5
            total += startup + cfg.steps * balanced / predicted_efficiency(share, batch, solo)
    return total


def analyze_slowdown(cfg: Config, ranks: list[Result], events: list[dict[str, Any]], ideal: float,
                     window: int) -> Result:
    """Rolling throughput after the slowdown and the steps it took to recover."""
    ends, batch, s = ranks[0]["ends"], cfg.batch, cfg.slowdown_step
    assert s is not None
    n = len(ends)  # ends[i - 1] is the end of step i
    rolling = {i: window * batch / (ends[i - 1] - ends[i - 1 - window]) for i in range(window + 1, n + 1)}
    recovered = next((i for i in range(s + window, n + 1) if rolling[i] >= 0.9 * ideal), None)
    before = batch * (s - cfg.skip) / (ends[s - 1] - ends[cfg.skip - 1]) if s > cfg.skip else None
    changes = [i + 1 for i in range(1, n) if ranks[0]["shares"][i] != ranks[0]["shares"][i - 1]]
    return {
        "slowdown_step": s, "window": window, "ideal_after": ideal,
        "throughput_before": before,
        "throughput_end": rolling[n] if n in rolling else None,
        "recovered_at_step": recovered,
        "steps_to_recover": None if recovered is None else recovered - s,
        "steps_after": n - s,
        "rolling": {str(i): v for i, v in rolling.items()},
        "share0_per_step": [x[0] for x in ranks[0]["shares"]],
        "share_changes_at_steps": changes,
        "multigpu_lines": events,
        "final_speeds": ranks[0]["speeds"],
        "other_load": other_load(ranks, s - 1, n - 1),
    }


def checks_for(rows: dict[str, Result], slow: Result, solo: tuple[float, float], batch: int) -> list[Result]:
    """Every check: measured value, target, and whether it is met."""
    auto = rows["auto"]["efficiency"]
    grid = [r for name, r in rows.items() if name.startswith("grid")]
    best = max(grid, key=lambda r: r["samples_per_s"])
    theory = predicted_efficiency(0.5, batch, solo)
    steps = slow["steps_to_recover"]
    return [
        {"check": "auto efficiency", "value": auto, "target": ">= 0.95", "ok": auto >= 0.95},
        {"check": f"auto / best grid ({best['name']})", "value": rows["auto"]["samples_per_s"] / best["samples_per_s"],
         "target": ">= 0.97", "ok": rows["auto"]["samples_per_s"] / best["samples_per_s"] >= 0.97},
        {"check": "equal-shares efficiency", "value": rows["equal"]["efficiency"],
         "target": f"~{theory:.2f} (theory)", "ok": abs(rows["equal"]["efficiency"] - theory) <= 0.05},
        {"check": "slowdown: steps to 0.9 of ideal", "value": steps,
         "target": "<= 50", "ok": steps is not None and steps <= 50},
    ]


def print_report(rows: dict[str, Result], slow: Result, checks: list[Result], solo_sum: float) -> None:
    print(f"\n{'config':<10} {'devices':<18} {'local batches':<14} {'share0':>6} {'step s':>7} {'samples/s':>10} "
          f"{'efficiency':>10} {'predicted':>9} {'other load':>10}")
    for r in rows.values():
        eff = f"{r['efficiency']:.3f}" if "efficiency" in r else "-"
        pred = f"{r['predicted']:.3f}" if r.get("predicted") is not None else "-"
        batches = "/".join(map(str, r["local_batches"]))
        print(f"{r['name']:<10} {r['devices']:<18} {batches:<14} {r['share0']:>6.3f} {r['step_s']:>7.2f} "
              f"{r['samples_per_s']:>10.1f} {eff:>10} {pred:>9} {r['other_load']:>10.2f}")
    print(f"{'(ideal)':<10} {'solo fast + slow':<18} {'':<14} {'':>6} {'':>7} {solo_sum:>10.1f} {1:>10.3f}")
    print("\n'share0': device 0's share after the last step; 'predicted': the efficiency of those shares if each "
          "device ran at its solo speed;\n'other load': cores' worth of CPU other processes used on these cores "
          "while the steps were timed")

    s = slow["slowdown_step"]
    print(f"\nmid-run slowdown (rank 1's quota 1.0 -> {SLOW_FRACTION:g} after step {s}, ratios='auto'):")
    if slow["throughput_before"] is not None:
        print(f"  before the slowdown: {slow['throughput_before']:.1f} samples/s; after it, other processes used "
              f"{slow['other_load']:.2f} core(s) of the run's cores")
    for e in slow["multigpu_lines"]:
        print(f"  step {e['step']:>3}: {e['line']}")
    print(f"  shares changed in steps {slow['share_changes_at_steps'] or 'none'} "
          f"(device 0's share after the last step: {slow['share0_per_step'][-1]:.3f})")
    target = 0.9 * slow["ideal_after"]
    if slow["recovered_at_step"] is None:
        print(f"  the {slow['window']}-step rolling throughput never reached {target:.1f} samples/s "
              f"(0.9 of {slow['ideal_after']:.1f}) in the {slow['steps_after']} steps after the slowdown")
    else:
        print(f"  {slow['window']}-step rolling throughput reached {target:.1f} samples/s (0.9 of the ideal "
              f"{slow['ideal_after']:.1f}) at step {slow['recovered_at_step']}: "
              f"{slow['steps_to_recover']} steps after the slowdown")
    if slow["throughput_end"] is not None:
        print(f"  last {slow['window']} steps: {slow['throughput_end']:.1f} samples/s "
              f"({slow['throughput_end'] / slow['ideal_after']:.3f} of the ideal)")

    print(f"\n{'check':<36} {'value':>7}  {'target':<14} result")
    for c in checks:
        value = "-" if c["value"] is None else f"{c['value']:.3f}" if isinstance(c["value"], float) else c["value"]
        print(f"{c['check']:<36} {value:>7}  {c['target']:<14} {'ok' if c['ok'] else 'MISSED'}")


def warnings_for(rows: dict[str, Result], slow: Result) -> list[str]:
    """Signs that the machine was not idle enough for the ratios to mean much."""
    out = []
    loads = {**{r["name"]: r["other_load"] for r in rows.values()}, "slowdown": slow["other_load"]}
    busy = [f"{name} ({load:.2f})" for name, load in loads.items() if load > 0.05]
    if busy:
        out.append("other processes used CPU on the benchmark's cores during the timed steps of: "
                   + ", ".join(busy) + " cores; the throughput ratios are unreliable, rerun on an idle machine")
    fast, slow = rows["solo fast"]["cpu_per_wall"][0], rows["solo slow"]["cpu_per_wall"][0]
    if fast < 0.9 or slow < 0.9 * SLOW_FRACTION:
        out.append(f"the solo runs got {fast:.2f} and {slow:.2f} cores (expected 1.0 and {SLOW_FRACTION:g})")
    return out


def plot(rows: dict[str, Result], slow: Result, solo_sum: float, path: Path, title: str) -> None:
    """Bars of throughput per configuration; the slowdown run's rolling throughput and share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.1, 1]})
    names = list(rows)
    colors = ["0.6" if n.startswith("solo") else "tab:orange" if n == "equal" else
              "tab:green" if n == "auto" else "tab:blue" for n in names]
    values = [rows[n]["samples_per_s"] for n in names]
    bars = left.bar(range(len(names)), values, color=colors)
    for bar, n in zip(bars, names):
        if "efficiency" in rows[n]:
            left.annotate(f"{rows[n]['efficiency']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          ha="center", va="bottom", fontsize=8)
    left.axhline(solo_sum, color="k", ls="--", lw=1, label=f"solo fast + slow = {solo_sum:.0f}")
    left.set_ylim(0, 1.18 * max(solo_sum, *values))
    left.set_xticks(range(len(names)), names, rotation=35, ha="right")
    left.set_ylabel("samples/s (global)")
    left.set_title("throughput per configuration (labels: efficiency)")
    left.legend(loc="upper left", fontsize=8)

    steps = [int(k) for k in slow["rolling"]]
    right.plot(steps, list(slow["rolling"].values()), "o-", ms=3, color="tab:green",
               label=f"{slow['window']}-step rolling throughput")
    right.axhline(slow["ideal_after"], color="k", ls="--", lw=1, label="ideal after the slowdown")
    right.axhline(0.9 * slow["ideal_after"], color="k", ls=":", lw=1, label="0.9 of that")
    right.axvline(slow["slowdown_step"] + 0.5, color="tab:red", lw=1, label="slowdown")
    if slow["recovered_at_step"] is not None:
        right.axvline(slow["recovered_at_step"], color="tab:green", ls=":", lw=1, label="recovered")
    right.set_xlabel("step")
    right.set_ylabel("samples/s")
    share = right.twinx()
    share.step(range(1, len(slow["share0_per_step"]) + 1), slow["share0_per_step"], where="post",
               color="tab:purple", label="device 0's share")
    share.set_ylim(0.3, 0.9)
    share.set_ylabel("device 0's share")
    lines = right.get_legend_handles_labels()
    more = share.get_legend_handles_labels()
    right.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    right.set_title("mid-run slowdown of device 1 (ratios='auto')")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cmd = command_line()
    print(f"command: {cmd}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or cores[:2] != [0, 1]:
        raise SystemExit(f"needs cores 0 and 1 (usable: {cores})")
    configs = configurations(a)
    print(f"convnet width {a.width:g}, global batch {a.batch}, devices {FAST} and {SLOW}, {a.steps} timed steps "
          f"after {a.warmup} warm-up (auto: {a.warmup + 1}), grid {a.grid}, slowdown after step "
          f"{a.slowdown_step} then {a.after} steps; {len(configs)} configurations, one after another")
    if a.quick:
        print("quick mode: a narrow net and few steps, where fixed per-step costs and the 100 ms quota "
              "period dominate; the ratios are not meaningful")
    began = time.perf_counter()
    runs: dict[str, tuple[Config, list[Result], list[dict[str, Any]]]] = {}
    rows: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="bench_balance_") as tmp:
        for i, cfg in enumerate(configs):
            ranks, events, wall = run_worker(cfg, a, Path(tmp))
            runs[cfg.name] = (cfg, ranks, events)
            if cfg.slowdown_step is None:
                rows[cfg.name] = measure(cfg, ranks)
                rows[cfg.name]["events"] = events
                rows[cfg.name]["wall_s"] = wall
            if cfg.name == "solo slow":
                solo = (rows["solo fast"]["samples_per_s"], rows["solo slow"]["samples_per_s"])
                startup = max(wall - (ranks[0]["ends"][-1] - ranks[0]["begin"]), 1.0)
                left = estimate_remaining(configs[i + 1:], solo, startup, a.batch)
                print(f"  solo speeds {solo[0]:.1f} and {solo[1]:.1f} samples/s: the remaining "
                      f"{len(configs) - i - 1} configurations should take ~{left / 60:.1f} min "
                      f"(whole run ~{(time.perf_counter() - began + left) / 60:.1f} min)", flush=True)
    solo = (rows["solo fast"]["samples_per_s"], rows["solo slow"]["samples_per_s"])
    solo_sum = sum(solo)
    for r in rows.values():
        if not r["name"].startswith("solo"):
            r["efficiency"] = r["samples_per_s"] / solo_sum
            r["predicted"] = predicted_efficiency(r["share0"], a.batch, solo)
    cfg, ranks, events = runs["slowdown"]
    slow = analyze_slowdown(cfg, ranks, events, solo_sum, a.window)
    checks = checks_for(rows, slow, solo, a.batch)
    print_report(rows, slow, checks, solo_sum)
    if rows["auto"]["events"]:
        print("\nauto run: " + "; ".join(f"step {e['step']}: {e['line']}" for e in rows["auto"]["events"]))
    notes = warnings_for(rows, slow)
    for note in notes:
        print(f"warning: {note}")
    elapsed = time.perf_counter() - began
    print(f"\nran in {elapsed / 60:.1f} min")

    a.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": cmd,
        "settings": {"model": "convnet", "width": a.width, "batch": a.batch, "devices": [FAST, SLOW],
                     "timed_steps": a.steps, "warmup": a.warmup, "grid": a.grid,
                     "slowdown_step": a.slowdown_step, "after": a.after, "window": a.window, "quick": a.quick},
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpu_count": os.cpu_count(), "usable_cores": cores},
        "solo": {"fast": solo[0], "slow": solo[1], "sum": solo_sum},
        "results": rows,
        "slowdown": slow,
        "checks": checks,
        "warnings": notes,
        "elapsed_s": elapsed,
    }
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    png = a.out.with_suffix(".png")
    plot(rows, slow, solo_sum, png, f"{cmd}  |  width {a.width:g}, batch {a.batch}")
    print(f"wrote {a.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
