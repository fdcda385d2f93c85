"""``multigpu devices``: the devices of this machine, for choosing and for bug reports.

    multigpu devices
    multigpu devices --json
"""

from __future__ import annotations

import argparse
import json
import platform


def add_parser(sub) -> None:
    p = sub.add_parser("devices", help="list the devices multigpu can use", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _meminfo() -> tuple[int, int]:
    total = free = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key == "MemTotal":
                    total = int(value.split()[0]) * 1024
                elif key == "MemAvailable":
                    free = int(value.split()[0]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return total, free


def collect() -> dict:
    """Everything ``multigpu devices`` reports, as a dict (the GPUs as the backend in use sees them)."""
    import importlib.metadata as md

    from multigpu import backend
    from multigpu.devices import usable_cores
    from multigpu.throttle import cgroup_status

    supported = backend.name() in backend.SUPPORTED
    facts = backend.facts() if supported else None
    gpus = facts.gpu_count() if facts else 0
    rows = [{"device": f"cuda:{i}", **facts.gpu_info(i)} for i in range(gpus)]
    total, free = _meminfo()
    cores = usable_cores()
    for k, core in enumerate(cores):
        rows.append({
            "device": f"cpu:{k}", "name": platform.processor() or platform.machine(),
            "cores": [core], "total_memory": total, "free_memory": free,
        })
    from multigpu import __version__

    versions = {"multigpu": __version__, "python": platform.python_version()}
    try:
        versions["keras"] = md.version("keras")
    except md.PackageNotFoundError:
        versions["keras"] = "not installed"
    if facts:
        versions.update(facts.versions())
    from multigpu.devices import driver_gpu_count, unusable_gpus

    return {
        "gpus": gpus, "driver_gpus": driver_gpu_count(), "unusable_gpus": unusable_gpus().strip() if not gpus else "",
        "cpu_cores": len(cores), "devices": rows,
        "versions": versions, "throttling": cgroup_status(), "keras_backend": backend.name(),
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    if info["unusable_gpus"]:
        print(f"GPUs not usable: {info['unusable_gpus']}")
    elif not info["gpus"]:
        print("No GPU found: CPU devices only (cpu:K, one or more cores each; cpu:K@0.5 for a slower one).")
    print(f"{'device':<10} {'name':<28} {'memory (free/total)':<22} detail")
    for row in info["devices"]:
        detail = (f"compute {row['compute_capability']}" if "compute_capability" in row
                  else f"core {','.join(map(str, row['cores']))}" if "cores" in row else "")
        mem = f"{_gib(row['free_memory'])}/{_gib(row['total_memory'])}" if "total_memory" in row else "unknown"
        print(f"{row['device']:<10} {row['name'][:28]:<28} {mem:<22} {detail}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"throttling (cpu:K@F): {info['throttling']}")
    return 0
