"""Which engine should sum gradients on the TensorFlow backend: all-reduce time, side by side in one run.

Two processes, each pinned to its own core (``OMP_NUM_THREADS=1``), sum a
float32 vector of each size over and over; the median time per all-reduce is
printed for:

* ``tf-ring``: TensorFlow's own collective ops, as ``tf.distribute`` runs them
  across processes: ``MultiWorkerMirroredStrategy`` with
  ``CommunicationImplementation.RING`` (ring over gRPC), a replica context's
  ``all_reduce`` inside ``strategy.run`` in a ``tf.function``;
* ``tf-auto``: the same with ``CommunicationImplementation.AUTO``;
* ``gloo``: ``torch.distributed.all_reduce`` on gloo (a NumPy array's memory);
* ``shm``: multigpu's shared-memory transport (``multigpu/engine/shm.py``),
  what the torch backend uses between CPU ranks of one machine.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tf_engines.py \\
        --out benchmarks/tensorflow/tf-engines.json

Needs ``tensorflow-cpu`` and torch (``make test`` installs both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multigpu.runtime.processes import free_port  # noqa: E402

ENGINES = ("tf-ring", "tf-auto", "gloo", "shm")
SIZES = (1_000, 100_000, 1_000_000, 4_000_000)  # float32 elements: 4 KB to 16 MB


def _times(reduce, size: int, reps: int) -> float:
    import numpy as np

    x = np.ones(size, dtype=np.float32)
    for _ in range(3):
        reduce(x)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = reduce(x)
        times.append(time.perf_counter() - start)
    assert abs(float(out[0]) - 2.0) < 1e-6, out[0]
    return statistics.median(times)


def _tf(rank: int, ports: list[int], implementation: str, sizes, reps) -> dict:
    import tensorflow as tf

    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": rank}})
    impl = getattr(tf.distribute.experimental.CommunicationImplementation, implementation.upper())
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=impl))
    out = {}
    for size in sizes:
        def replica(t):  # a value made on the replica's device (a tensor from outside has none)
            return tf.distribute.get_replica_context().all_reduce("sum", tf.identity(t))

        @tf.function
        def step(v):
            return strategy.run(replica, args=(v,))

        def reduce(x, step=step):
            return step(tf.constant(x)).numpy()

        out[size] = _times(reduce, size, reps)
    return out


def _torch(rank: int, port: int, transport: str, sizes, reps) -> dict:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from multigpu.devices import Device
    from multigpu.engine.comm import Comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    devices = [Device("cpu", 0), Device("cpu", 1)]
    comm = Comm(SimpleNamespace(rank=rank, world_size=2, devices=devices, device=devices[rank], same_host=True,
                                timeout=60.0), transport)
    out = {}
    for size in sizes:
        def reduce(x, size=size):
            buf = comm.buffer(size)
            buf.copy_(torch.from_numpy(x))
            return comm.reduce(buf).numpy()

        out[size] = _times(reduce, size, reps)
    dist.barrier()
    return out


def worker(a) -> None:
    os.sched_setaffinity(0, {a.rank % (os.cpu_count() or 1)})
    sizes = [int(s) for s in a.sizes.split(",")]
    ports = [int(p) for p in a.ports.split(",")]
    if a.engine.startswith("tf-"):
        result = _tf(a.rank, ports, a.engine[3:], sizes, a.reps)
    else:
        result = _torch(a.rank, ports[0], a.engine, sizes, a.reps)
    if a.rank == 0:
        Path(a.result).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # gloo's and gRPC's threads can hold up a normal exit


def run_engine(engine: str, sizes, reps: int, timeout: float) -> dict | str:
    import tempfile

    ports = [str(free_port()), str(free_port())]
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT),
               KERAS_BACKEND="torch")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--engine", engine, "--rank", str(r),
                                   "--ports", ",".join(ports), "--sizes", ",".join(map(str, sizes)),
                                   "--reps", str(reps), "--result", str(result)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        try:
            outs = [p.communicate(timeout=timeout)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return f"timed out after {timeout:g} s"
        failed = [(r, p.returncode, out) for r, (p, out) in enumerate(zip(procs, outs)) if p.returncode]
        if failed or not result.exists():
            r, code, out = failed[0] if failed else (0, 0, outs[0])
            lines = [line for line in out.splitlines() if line.strip() and not line.startswith(("I0000", "WARNING"))]
            return f"failed: rank {r} exited with code {code}: " + " | ".join(lines[-3:])
        return {int(k): v for k, v in json.loads(result.read_text()).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "tensorflow" / "tf-engines.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ports", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    sizes = [int(s) for s in a.sizes.split(",")]
    engines = a.engines.split(",")
    rounds: dict = {e: [] for e in engines}
    for r in range(a.rounds):
        for engine in engines:
            got = run_engine(engine, sizes, a.reps, a.timeout)
            rounds[engine].append(got)
            shown = got if isinstance(got, str) else ", ".join(f"{n}: {t * 1e3:.3f} ms" for n, t in got.items())
            print(f"round {r + 1} {engine:8s} {shown}", flush=True)
    best = {e: {n: min(g[n] for g in runs if isinstance(g, dict)) for n in sizes}
            for e, runs in rounds.items() if any(isinstance(g, dict) for g in runs)}
    against = [e for e in best if e != "shm"] if "shm" in best else []
    print("\n| floats | " + " | ".join([f"{e} (ms)" for e in best] + [f"{e} / shm" for e in against]) + " |")
    print("|---:|" + "---:|" * (len(best) + len(against)))
    for n in sizes:
        cells = [f"{best[e][n] * 1e3:.3f}" for e in best]
        ratios = [f"{best[e][n] / best['shm'][n]:.1f}x" for e in against]
        print(f"| {n:,} | " + " | ".join(cells + ratios) + " |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rounds": rounds, "best_seconds": best}, indent=1, default=str))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
