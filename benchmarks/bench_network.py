"""Two simulated hosts joined by a shaped link: multigpu against PyTorch DDP where the link is slow.

    sudo KERAS_BACKEND=torch OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_network.py   # 42 runs, ~35 s each
    ... benchmarks/bench_network.py --rates 1gbit --models dense21m --configs exact,ddp --rounds 1     # one case
    ... benchmarks/bench_network.py --backend jax --rates 1gbit --models dense21m --configs exact          # JAX

Each rank runs in a network namespace of its own (``benchmarks/links.py``): two
namespaces joined by a veth pair that a token-bucket filter holds to ``--rates``
in each direction (this kernel has no netem, so the link has a rate and no added
delay).  The ranks join with torchrun's variables over gloo, rank ``r`` on core
``r``, one configuration after another in fresh processes, ``--rounds`` rounds
(the median counts: with two rounds, their mean).  Configurations:

* ``exact``: multigpu, exact sums, equal shares (gradient sums started during the
  backward pass: the default between hosts);
* ``exact-after``: the same with ``MULTIGPU_OVERLAP=0`` (sums after the backward pass);
* ``exact-bN`` (asked for by name, e.g. ``exact-b25``): ``exact`` with buckets of N MiB
  (``MULTIGPU_BUCKET_MB``; the default is 4);
* ``bf16``, ``fp16``: multigpu with ``compression=``;
* ``ddp``: a hand-written PyTorch DDP loop (buckets all-reduced during backward), equal shares;
* ``ddp-bf16``: the same with DDP's ``bf16_compress_hook``;
* ``auto-slow``: multigpu on ``cpu:0`` and ``cpu:1@0.5`` (a throttled device on
  host 1, needs the cgroup quota), automatic shares;
* ``auto-park``: multigpu on ``cpu:0`` and ``cpu:1``, automatic shares, the steps over four epochs (a device
  that does not pay is set aside from a fit's second epoch: the result says which, ``aside``);
* ``alone``: the model on host 0's core alone, plain Keras (no link), the same steps.

Models: ``dense21m`` (dense41m at width 0.57: 21.2M parameters, batch 256),
``convnet_head`` (the convnet's body at width 0.5 with a 4M-parameter dense head,
batch 256), ``gru`` (batch 256).  Prints ratios against the DDP loop in one run
and writes ``benchmarks/network/network.json``.  Without root it says why and
exits with status 0 having run nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.links import Link, unavailable  # noqa: E402

MODELS = {"dense21m": ("dense41m", 0.57, 256), "convnet_head": ("convnet_head", 0.5, 256), "gru": ("gru", 1.0, 256)}
CONFIGS = ("exact", "exact-after", "bf16", "fp16", "ddp", "ddp-bf16", "auto-slow", "auto-park", "alone")
STEPS = {"100mbit": (4, 2), "1gbit": (12, 3), "10gbit": (30, 5)}  # timed steps, warm-up steps


def _config(name: str, model: str, width: float, batch: int, steps: int, warmup: int) -> tuple[dict, dict]:
    """The worker's configuration and the extra environment of one run."""
    cfg = {"model": model, "width": width, "batch": batch, "steps": steps, "warmup": warmup,
           "devices": ["cpu:0", "cpu:1"], "ratios": "1,1", "mode": "multigpu"}
    extra: dict = {}
    if name == "exact-after":
        extra["MULTIGPU_OVERLAP"] = "0"
    elif name.startswith("exact-b"):  # exact-b25: buckets of 25 MiB
        extra["MULTIGPU_BUCKET_MB"] = name.removeprefix("exact-b")
    elif name in ("bf16", "fp16"):
        cfg["compression"] = name
    elif name.startswith("ddp"):
        cfg.update(mode="ddp", compression=name.partition("-")[2] or None)
    elif name == "auto-slow":
        cfg.update(devices=["cpu:0", "cpu:1@0.5"], ratios="auto", steps=steps * 3, warmup=warmup * 4)
    elif name == "auto-park":
        cfg.update(ratios="auto", steps=steps * 4, warmup=steps * 2, epochs=4)
    elif name == "alone":
        cfg.update(mode="single", devices=["cpu:0"], cores=[0], ratios=None, steps=steps * 4, warmup=steps * 2,
                   epochs=4)
    return cfg, extra


def run_one(link: Link, cfg: dict, extra: dict, timeout: float, backend: str = "torch") -> dict:
    """Both ranks of one configuration, each in its host's namespace; returns rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="multigpu-bench-net-") as tmp:
        out = Path(tmp) / "result.json"
        cfg = dict(cfg, out=str(out))
        if cfg["ratios"] == "auto":
            cfg["profile"] = str(Path(tmp) / "profile.json")
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        port = 29500 + os.getpid() % 1000  # inside the link's fresh namespaces: no other listener there
        base = dict(os.environ, KERAS_BACKEND=backend, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                    PYTHONPATH=str(ROOT), MULTIGPU_PROFILE=str(Path(tmp) / "profiles.json"), **extra)
        argv = [sys.executable, "-m", "multigpu.runtime.rank_entry", "module", "multigpu.bench.worker",
                str(Path(tmp) / "config.json")]
        procs, logs = [], []
        for rank in range(2):
            log = open(Path(tmp) / f"rank{rank}.log", "w")
            logs.append(log)
            command = link.command(rank, argv, own_hosts_file=backend == "jax")
            procs.append(subprocess.Popen(command, env=dict(base, **link.rank_env(rank, port)),
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if bad or time.monotonic() > deadline:
                    why = f"rank {bad[0]} failed" if bad else f"timed out after {timeout:.0f} s"
                    tail = (Path(tmp) / f"rank{bad[0] if bad else 0}.log").read_text()[-3000:]
                    raise RuntimeError(f"{why}: {cfg['mode']} {cfg['model']}\n{tail}")
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
            for log in logs:
                log.close()
        return json.loads(out.read_text())


def _sum_share(res: dict) -> str:
    """The share of rank 0's time its report puts in the gradient sum itself (multigpu runs), or ``-``."""
    report = res.get("report") or {}
    rows = report.get("devices") or []
    if not rows:
        return "-"
    row = rows[0]
    total = row["data"] + row["compute"] + row["wait"]
    return f"{row.get('sum', 0.0) / total:.0%}" if total else "-"


def _ratio(rate: dict, x: str, y: str) -> str:
    return f"{rate[x] / rate[y]:.2f}x" if x in rate and y in rate else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit,10gbit", help="comma-separated tc rates (100mbit, 1gbit, 10gbit)")
    p.add_argument("--models", default="dense21m,convnet_head,gru")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--backend", default="torch", choices=["torch", "jax"],
                   help="jax: multigpu's configurations only (exact, bf16, fp16, auto-slow); the report's `sum` "
                        "column is the all-reduce's share of the step")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "network" / "network.json"))
    a = p.parse_args()
    configs = a.configs.split(",")
    buckets = [c.removeprefix("exact-b").replace(".", "", 1) for c in configs if c.startswith("exact-b")]
    unknown = [c for c in configs if c not in CONFIGS and not c.startswith("exact-b")]
    unknown += [f"exact-b{b}" for b in buckets if not b.isdigit()]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; allowed: {', '.join(CONFIGS)}, or exact-bN (N MiB buckets)")
    models = [m for m in a.models.split(",") if m not in MODELS]
    if models:
        p.error(f"unknown model(s) {models}; allowed: {', '.join(MODELS)}")
    if a.backend == "jax":
        configs = [c for c in configs if c in ("exact", "bf16", "fp16", "auto-slow")]
    why = unavailable()
    if why:
        print(f"bench_network.py: skipped: {why}.")
        return 0
    results: dict = {"machine": f"{platform.node()} {os.cpu_count()} cores", "runs": {}}
    for rate in a.rates.split(","):
        steps, warmup = STEPS.get(rate, (10, 3))
        with Link(rate) as link:
            for model_name in a.models.split(","):
                model, width, batch = MODELS[model_name]
                rows: dict[str, list[dict]] = {}
                for round_ in range(a.rounds):
                    for name in configs:
                        cfg, extra = _config(name, model, width, batch, steps, warmup)
                        if name == "alone":  # one host: no link, no rank to join
                            from multigpu.bench.runs import run_config

                            res = run_config(dict(cfg, env=dict(extra)), 1200, stream=False)
                        else:
                            res = run_one(link, cfg, extra, timeout=1200, backend=a.backend)
                        if cfg.get("epochs", 1) > 1:  # the last two epochs' steps (a device set aside by then)
                            late = res["step_times"][-2 * ((cfg["steps"] + cfg["warmup"]) // cfg["epochs"]):]
                            res["late"] = batch * len(late) / sum(late)
                        rows.setdefault(name, []).append(res)
                        print(f"  {rate:7s} {model_name:13s} round {round_ + 1} {name:12s} "
                              f"{res['samples_per_second']:8.1f} samples/s  gradient sum {_sum_share(res)}"
                              + (f"  shares {res.get('shares')}" if name == "auto-slow" else "")
                              + (f"  last two epochs {res['late']:.1f} samples/s" if "late" in res else "")
                              + (f"  judgment {res.get('judgment')}" if name == "auto-park" else ""), flush=True)
                median = {n: sorted(rs, key=lambda r: r["samples_per_second"])[(len(rs) - 1) // 2]
                          for n, rs in rows.items()}  # the run whose shares and report are kept
                results["runs"][f"{rate}/{model_name}" + ("/jax" if a.backend == "jax" else "")] = {
                    n: {"samples_per_second": statistics.median(r["samples_per_second"] for r in rows[n]),
                        "shares": m.get("shares"), "judgment": m.get("judgment"), "late": m.get("late"),
                        "overlap": m.get("overlap"), "report": m.get("report"),
                        "rounds": [r["samples_per_second"] for r in rows[n]]} for n, m in median.items()}
    print("\n| link | model | " + " | ".join(configs) + " | exact / ddp | bf16 / ddp-bf16 |")
    print("|---|---|" + "---:|" * (len(configs) + 2))
    for key, r in results["runs"].items():
        rate = {n: v["samples_per_second"] for n, v in r.items()}
        print(f"| {' | '.join(key.split('/')[:2])} | " + " | ".join(f"{rate[n]:.0f}" for n in configs)
              + f" | {_ratio(rate, 'exact', 'ddp')} | {_ratio(rate, 'bf16', 'ddp-bf16')} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
