"""The training state in parts against the whole one on every device: peak memory and samples/s, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/optimizer_sharding/bench_sharding.py             # ~9 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/optimizer_sharding/bench_sharding.py --rounds 1  # ~3 min

A dense model of 29.4M weights (2048 -> 4096 -> 4096 -> 1024 -> 10) trained with Adam for two epochs of
12 steps at global batch 64, each run a plain ``python script.py`` (``_script.py``) in fresh processes:
the whole state (``shard_optimizer=False``), ``shard="optimizer"``, ``"gradients"`` and ``"weights"`` (``--levels``;
torch only) on 2 devices at 1:1 and on 3 devices at 1:2:5, interleaved, ``--rounds`` times.  Memory: the peak
PSS of the whole process tree (the supervisor and every rank; shared pages counted once), sampled every 0.1 s,
and each rank's own peak resident memory (``VmHWM``).  Speed: the second epoch's samples/s.  Adam's two
moments of 29.4M float32 weights are 235 MB, one copy of the weights or of the gradients 118 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "memory"))

from bench_host import peak_pss  # noqa: E402


def run(devices: str, ratios: str, shard: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-sharding-") as tmp:
        out = os.path.join(tmp, "out.json")
        command = [sys.executable, os.path.join(HERE, "_script.py"), out, "--devices", devices, "--ratios", ratios]
        peak, seconds, code = peak_pss([*command, "--shard", shard])
        if code:
            raise SystemExit(f"{' '.join(command)} failed ({code})")
        with open(out) as f:
            result = json.load(f)
        ranks = [result["peak_rss_mb"]]
        for r in range(1, len(devices.split(","))):
            with open(f"{out}.rank{r}") as f:
                ranks.append(json.load(f)["peak_rss_mb"])
    return {"tree_pss_mb": peak, "rank_rss_mb": ranks, "samples_per_second": result["samples_per_second"],
            "seconds": seconds, "weights": result["weights"], "backend": result["backend"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=["cpu:0,cpu:1=1,1", "cpu:0,cpu:1,cpu:2=1,2,5"])
    p.add_argument("--levels", nargs="+", default=["none", "optimizer", "gradients"],
                   choices=["none", "optimizer", "gradients", "weights"])
    p.add_argument("--out", default=os.path.join(HERE, "sharding.json"))
    a = p.parse_args()
    start = time.monotonic()
    results: dict[str, dict[str, list[dict]]] = {}
    for _ in range(a.rounds):
        for case in a.cases:
            devices, ratios = case.split("=")
            for shard in a.levels:
                r = run(devices, ratios, shard)
                results.setdefault(case, {}).setdefault(shard, []).append(r)
                print(f"[{time.monotonic() - start:4.0f} s] {case} shard={shard}: tree peak PSS "
                      f"{r['tree_pss_mb']:.0f} MB, ranks' peak RSS {', '.join(f'{m:.0f}' for m in r['rank_rss_mb'])}"
                      f" MB, {r['samples_per_second']:.1f} samples/s", flush=True)
    for case, by in results.items():
        weights = next(iter(by.values()))[0]["weights"]
        copy = 4 * weights / 1e6 / 1.048576  # one copy of the weights or of the gradients, MiB
        pss = {level: statistics.median(r["tree_pss_mb"] for r in rs) for level, rs in by.items()}
        speed = {level: statistics.median(r["samples_per_second"] for r in rs) for level, rs in by.items()}
        for level in by:
            line = f"{case} {level}: tree peak PSS {pss[level]:.0f} MB, {speed[level]:.1f} samples/s"
            if level != "none" and "none" in by:
                line += (f"; against the whole state {pss['none'] - pss[level]:.0f} MB less "
                         f"({(pss['none'] - pss[level]) / (2 * copy):.2f}x Adam's moments), "
                         f"{speed[level] / speed['none']:.3f}x the samples/s")
            if level == "gradients" and "optimizer" in by:
                line += (f"; against the optimizer in parts {pss['optimizer'] - pss[level]:.0f} MB less "
                         f"({(pss['optimizer'] - pss[level]) / copy:.2f}x one copy of the gradients, {copy:.0f} MB)")
            print(line + f"; medians of {a.rounds}")
    with open(a.out, "w") as f:
        json.dump({"command": sys.argv, "results": results}, f, indent=1)
    print(f"{(time.monotonic() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
