"""``multigpu devices``: the devices of this machine, for choosing and for bug reports."""

from __future__ import annotations

import argparse
import json
import os
import platform


def add_parser(sub) -> None:
    p = sub.add_parser("devices", help="list the devices multigpu can use")
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


def _driver_gpu_name(index: int, root: str = "/proc/driver/nvidia/gpus") -> str:
    """The model the NVIDIA driver reports for its ``index``-th GPU, or ``"NVIDIA GPU"``."""
    try:
        folder = sorted(os.listdir(root))[index]
        with open(os.path.join(root, folder, "information")) as f:
            for line in f:
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    except (OSError, IndexError):
        pass
    return "NVIDIA GPU"


def collect() -> dict:
    """Everything ``multigpu devices`` reports, as a dict."""
    import torch

    from multigpu.devices import cuda_device_count, usable_cores
    from multigpu.throttle import cgroup_status

    rows = []
    for i in range(cuda_device_count()):
        if not torch.cuda.is_available():  # JAX's GPUs beside a CPU build of torch: the driver's name only
            rows.append({"device": f"cuda:{i}", "name": _driver_gpu_name(i)})
            continue
        prop = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        rows.append({
            "device": f"cuda:{i}", "name": prop.name, "total_memory": total, "free_memory": free,
            "compute_capability": f"{prop.major}.{prop.minor}",
        })
    total, free = _meminfo()
    cores = usable_cores()
    for k, core in enumerate(cores):
        rows.append({
            "device": f"cpu:{k}", "name": platform.processor() or platform.machine(),
            "cores": [core], "total_memory": total, "free_memory": free,
        })
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import importlib.metadata as md

        versions["keras"] = md.version("keras")
    except Exception:
        versions["keras"] = "not installed"
    versions["cuda"] = torch.version.cuda or "none"
    if torch.cuda.is_available():
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "gpus": cuda_device_count(), "cpu_cores": len(cores), "devices": rows,
        "versions": versions, "throttling": cgroup_status(), "keras_backend": os.environ.get("KERAS_BACKEND"),
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    if not info["gpus"]:
        print("No GPU found: CPU devices only (cpu:K, one or more cores each; cpu:K@0.5 for a slower one).")
    print(f"{'device':<10} {'name':<28} {'memory (free/total)':<22} detail")
    for row in info["devices"]:
        detail = (f"compute {row['compute_capability']}" if "compute_capability" in row
                  else f"core {','.join(map(str, row['cores']))}")
        mem = f"{_gib(row['free_memory'])}/{_gib(row['total_memory'])}"
        print(f"{row['device']:<10} {row['name'][:28]:<28} {mem:<22} {detail}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"throttling (cpu:K@F): {info['throttling']}")
    return 0
