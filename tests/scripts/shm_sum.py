"""Two ranks sum vectors through shared memory (torch only, no Keras).

    python shm_sum.py RANK PORT MODE      MODE: sums | mismatch | late
"""

import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from multigpu.devices import Device
from multigpu.engine.comm import Comm


def main() -> int:
    rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    runtime = SimpleNamespace(rank=rank, world_size=2, devices=[Device("cpu", 0), Device("cpu", 1)],
                              device=Device("cpu", rank), timeout=3.0, same_host=True)
    comm = Comm(runtime, "shm")
    assert comm.transport == "shm"
    if mode == "sums":
        for n in (1, 7, 1000, 300_000, 5):  # 300k makes the segment grow
            for dtype in (torch.float32, torch.bfloat16):
                buf = comm.buffer(n, dtype)
                buf.copy_(torch.arange(n, dtype=torch.float32).to(dtype) * (rank + 1))
                out = comm.reduce(buf, tag=n)
                base = torch.arange(n, dtype=torch.float32).to(dtype)
                expected = base * 1 + base * 2  # summed in the dtype sent
                assert torch.equal(out, expected), (n, dtype)
        print(f"rank {rank} sums ok", flush=True)
    elif mode == "mismatch":
        buf = comm.buffer(10 + rank)
        comm.reduce(buf, tag=1, describe=lambda: f"{10 + rank} values")
    elif mode == "late":
        comm.reduce(comm.buffer(4), tag=1)  # the segment exists; now rank 1 is late
        if rank == 1:
            time.sleep(30)
        comm.reduce(comm.buffer(4), tag=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
