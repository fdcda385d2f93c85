"""Host memory of a run against one device: peak PSS of the whole process tree, side by side in one run.

A script ``np.load``s SIZE of float32 features at its top (``_script.py``) and trains a small dense model for
one epoch, on one device and on N CPU devices at equal shares, with the arrays read four ways: ``plain``
(``np.load``), ``mmap`` (``np.load(..., mmap_mode="r")``), ``load_once`` (``multigpu.load_once(np.load, path)``,
each file read straight into shared memory) and ``load_once_fn`` (``multigpu.load_once(fn)`` of a function that
``np.load``s both files: its arrays copied into shared memory).  ``--without-jax`` hides an installed JAX from
the script's processes (Keras otherwise imports it, about 100 MB a process).
PSS (proportional set size) counts a page shared by k processes as 1/k in each, so the tree's sum counts
shared memory once.  Also checks that nothing is left in ``/dev/shm`` and no process outlives its run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_host.py            # 1.2 GB, 2 and 8 devices
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_host.py --gb 0.3   # quicker
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_host.py --devices 2 --modes plain load_once \
        --without-jax
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FEATURES = 1000


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_pss(command: list[str], interval: float = 0.1, hide: str | None = None) -> tuple[float, float, int]:
    """Runs ``command`` (with the folder ``hide`` first on its path); returns (peak PSS of its process tree in MB,
    seconds, exit code)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "torch")}
    if hide:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (hide, os.environ.get("PYTHONPATH")) if p)
    began = time.time()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, sum(pss_kb(p) for p in tree(proc.pid)))
        time.sleep(interval)
    err = proc.stderr.read().decode(errors="replace")
    if proc.returncode:
        print(err[-3000:], file=sys.stderr)
    return peak / 1024, time.time() - began, proc.returncode


def leftovers(shm_before: set[str], marker: str) -> list[str]:
    left = [f"/dev/shm/{n}" for n in set(os.listdir("/dev/shm")) - shm_before]
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False).stdout.split()
    return left + [f"process {p}" for p in out if int(p) != os.getpid()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.2, help="size of the features (default 1.2)")
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 8], help="device counts (default 2 8)")
    parser.add_argument("--modes", nargs="+", default=["plain", "mmap", "load_once", "load_once_fn"])
    parser.add_argument("--without-jax", action="store_true", help="hide an installed JAX from the script")
    args = parser.parse_args()
    script = os.path.join(HERE, "_script.py")
    with tempfile.TemporaryDirectory(prefix="multigpu-bench-memory-") as folder:
        rows = int(args.gb * 1e9 / (4 * FEATURES))
        rng = np.random.default_rng(0)
        x = np.lib.format.open_memmap(os.path.join(folder, "x.npy"), "w+", np.float32, (rows, FEATURES))
        for start in range(0, rows, 65536):
            x[start : start + 65536] = rng.standard_normal((min(65536, rows - start), FEATURES), np.float32)
        x.flush()
        del x
        np.save(os.path.join(folder, "y.npy"), rng.integers(0, 10, rows).astype(np.int64))
        tiny = os.path.join(folder, "tiny")
        os.makedirs(tiny)
        np.save(os.path.join(tiny, "x.npy"), np.zeros((4096, FEATURES), np.float32))
        np.save(os.path.join(tiny, "y.npy"), np.zeros(4096, np.int64))
        hide = None
        if args.without_jax:  # a package named jax that cannot be imported: Keras then goes on without JAX
            hide = os.path.join(folder, "hide")
            os.makedirs(os.path.join(hide, "jax"))
            with open(os.path.join(hide, "jax", "__init__.py"), "w") as f:
                f.write('raise ImportError("JAX is hidden from this process (bench_host.py --without-jax)")\n')
        shm_before = set(os.listdir("/dev/shm"))
        print(f"features: {rows} x {FEATURES} float32 = {rows * FEATURES * 4 / 1e6:.0f} MB; "
              f"{os.cpu_count()} cores; JAX {'hidden' if hide else 'as installed'}", flush=True)
        results: dict[tuple[str, int], float] = {}
        for mode in args.modes:
            for n in [1, *args.devices]:
                devices = ",".join(f"cpu:{i}" for i in range(n))
                mb, secs, code = peak_pss([sys.executable, script, folder, mode, devices], hide=hide)
                results[(mode, n)] = mb
                base = results[(mode, 1)]
                plain = results.get(("plain", 1))
                against = f", {mb / plain:.2f}x one device's plain np.load" if plain and mode != "plain" else ""
                print(f"{mode:12s} {n} device(s): peak PSS of the tree {mb:7.0f} MB  {mb / base:.2f}x one device"
                      f"{against}  ({secs:.0f} s, exit {code})", flush=True)
        for n in args.devices:
            if n > 2 and "load_once" in args.modes:
                devices = ",".join(f"cpu:{i}" for i in range(n))
                bare, _, _ = peak_pss([sys.executable, script, tiny, "plain", devices], hide=hide)
                one = results[("load_once", 1)]
                got = results[("load_once", n)]
                print(f"load_once {n} devices: {got:.0f} MB against one device's {one:.0f} MB + {n} bare ranks' "
                      f"{bare:.0f} MB = {one + bare:.0f} MB: {'within' if got <= one + bare else 'ABOVE'}",
                      flush=True)
        left = leftovers(shm_before, "benchmarks/memory/_script.py")
        print("left behind:", ", ".join(left) if left else "nothing (no /dev/shm file, no process)")


if __name__ == "__main__":
    main()
