"""gloo's reduce-scatter against its all-reduce, side by side: what the gradients in parts would send between
machines in place of the whole sum.

Two processes, each pinned to its own core, join a gloo group and time, interleaved,
``torch.distributed.all_reduce`` of a float32 vector and ``torch.distributed.reduce_scatter`` of the same vector
into two uneven parts (a third and two thirds: parts by memory), the median of ``--repeats`` calls per size.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/optimizer_sharding/bench_gloo_scatter.py     # ~10 s
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/optimizer_sharding/bench_gloo_scatter.py --rate 1gbit

``--rate``: the two processes on two simulated hosts joined by a link shaped to that rate
(:mod:`benchmarks.links`: network namespaces, root), over TCP; without it, on this machine over a file store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(rank: int, init: str, sizes: list[int], repeats: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    for n in sizes:
        vector = torch.ones(n)
        cut = [n // 3, n - n // 3]
        mine = torch.empty(cut[rank])
        calls = {"all-reduce": lambda v=vector: dist.all_reduce(v),
                 "reduce-scatter": lambda v=vector, m=mine, c=cut: dist.reduce_scatter(m, list(torch.split(v, c)))}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():
            call()
        for _ in range(repeats):
            for name, call in calls.items():
                dist.barrier()
                began = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - began)
        if rank == 0:
            a, s = (statistics.median(times[k]) * 1e3 for k in ("all-reduce", "reduce-scatter"))
            print(f"{n:>10,} floats: all-reduce {a:7.2f} ms, reduce-scatter {s:7.2f} ms, "
                  f"reduce-scatter / all-reduce {s / a:.2f}x", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000,4000000,16000000")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rate", default=None, help="a simulated link between two hosts, e.g. 1gbit")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        commands = []
        if args.rate is None:
            init = f"file://{os.path.join(folder, 'store')}"
            place = [[], []]
        else:
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from links import Link

            link = stack.enter_context(Link(args.rate))
            init = f"tcp://{link.addresses[0]}:29517"
            place = [link.command(rank, []) for rank in range(2)]
        for rank in range(2):
            argv = ["taskset", "-c", str(rank), sys.executable, __file__, "--worker", str(rank), init, args.sizes,
                    str(args.repeats)]
            extra = {} if args.rate is None else {"GLOO_SOCKET_IFNAME": link.interfaces[rank]}
            commands.append((place[rank] + argv, {**env, **extra}))
        procs = [subprocess.Popen(argv, env=e) for argv, e in commands]
        try:
            codes = [p.wait(timeout=900) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], [int(v) for v in sys.argv[4].split(",")], int(sys.argv[5]))
    else:
        main()
