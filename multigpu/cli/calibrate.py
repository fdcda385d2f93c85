"""``multigpu calibrate``: measure each device, find its largest batch, suggest ratios.

    multigpu calibrate --devices cpu:0 cpu:1@0.5 --model convnet --sizes 32,64,128,256
    multigpu calibrate --devices 0 1 --model mine.py:build --memory-budget 8

Each device runs alone (one at a time; their processes start at once and
wait for their turn after importing and building) at increasing local batch sizes: on a
GPU until CUDA runs out of memory (the cache is freed after), on a CPU until
its peak memory passes ``--memory-budget`` GiB, if given.  It prints a table
per device and the suggested ratios, and writes them to the profile that
``parallelize(..., ratios="auto")`` reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure device speeds and batch limits, write a profile",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", "--gpus", default="auto",
                   help="devices, e.g. 0,1 or 0 1 or cpu:0 cpu:1@0.5 (default: auto, every GPU)")
    p.add_argument("--model", default="convnet", help="convnet, mlp, gru, maxing, dense41m or file.py:fn")
    p.add_argument("--width", type=float, default=1.0)
    p.add_argument("--sizes", default="32,64,128,256,512", help="local batch sizes to try, ascending")
    p.add_argument("--memory-budget", type=float, default=None, help="GiB per CPU device (default: no limit)")
    p.add_argument("--profile", type=Path, default=None, help="profile file (default: the user cache)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--timeout", type=float, default=1800)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from multigpu import backend
    from multigpu.balancing.profiles import default_profile_path, profile_key, write_profile
    from multigpu.bench.models import get_model
    from multigpu.bench.runs import run_in_turn
    from multigpu.devices import assign_cores, parse_devices

    devices = assign_cores(parse_devices(args.devices, num_gpus=backend.gpu_count))
    get_model(args.model)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",")})
    except ValueError:
        raise ValueError(f"--sizes takes comma-separated integers. Received: {args.sizes!r}") from None
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"--sizes must be positive. Received: {args.sizes!r}")
    if args.memory_budget is not None and args.memory_budget <= 0:
        raise ValueError(f"--memory-budget must be positive GiB. Received: {args.memory_budget}")
    budget = None if args.memory_budget is None else int(args.memory_budget * 2**30)
    configs = []
    for dev in devices:
        spec = dev.spec if dev.is_cuda else "cpu:0" + (f"@{dev.speed:g}" if dev.speed != 1.0 else "")
        configs.append({"mode": "calibrate", "model": args.model, "width": args.width, "devices": [spec],
                        "sizes": sizes, "memory_budget": budget, "cores": list(dev.cores), "batch": sizes[0],
                        "steps": 2})
    results = run_in_turn(configs, args.timeout)  # one device at a time, their processes started at once
    speeds, caps = [], []
    for res in results:
        fitting = [r for r in res["rows"] if r.get("fits")]
        speeds.append(fitting[-1]["samples_per_second"] if fitting else 0.0)
        caps.append(fitting[-1]["batch"] if fitting else 0)
    total = sum(speeds) or 1.0
    ratios = [s / total for s in speeds]
    if args.json:
        print(json.dumps({"devices": results, "ratios": ratios, "largest_batch": caps,
                          "largest_global_batch": sum(caps)}, indent=2))
    else:
        for dev, res in zip(devices, results):
            print(f"{dev.label}")
            print(f"  {'batch':>7} {'samples/s':>11} {'memory MiB':>11}  fits")
            for r in res["rows"]:
                sps = f"{r['samples_per_second']:.1f}" if "samples_per_second" in r else "-"
                mem = f"{r['memory'] / 2**20:.0f}" if "memory" in r else "-"
                print(f"  {r['batch']:>7} {sps:>11} {mem:>11}  {'yes' if r['fits'] else 'no: ' + r['reason']}")
        print("largest batch that fits: " + ", ".join(
            f"{d.label} {c if c < sizes[-1] or not all(r['fits'] for r in res['rows']) else f'>= {c}'}"
            for d, c, res in zip(devices, caps, results)))
        together = sum(caps)
        bounded = all(c < sizes[-1] or not all(r["fits"] for r in res["rows"]) for c, res in zip(caps, results))
        print(f"largest global batch the devices hold together: {together if bounded else f'>= {together}'}")
        print("suggested ratios: " + ", ".join(f"{r:.3f}" for r in ratios)
              + "   (pass as ratios=[...] or let ratios='auto' read the profile)")
    path = args.profile or default_profile_path()
    specs = [d.spec for d in devices]
    write_profile(path, profile_key(results[0]["signature"], specs), {
        "devices": specs, "speeds": speeds, "ratios": ratios, "largest_batch": caps, "model": args.model,
        "source": "multigpu calibrate",
    })
    print(f"wrote the profile {path}")
    return 0
