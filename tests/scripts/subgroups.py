"""Sums over part of the ranks (devices set aside) beside sums over every rank, on a real run of the backend in use.

    KERAS_BACKEND=torch multigpu run --devices cpu:0,cpu:1,cpu:2 subgroups.py OUT TRANSPORT

Every rank sums; then ranks 0 and 1 sum among themselves three times while rank 2 waits, then every rank sums;
then ranks 1 and 2 twice while rank 0 waits, then every rank again.  The rank that waits reads the result of its
last sum over every rank only after the others' sums among themselves (the engine's result stays valid until its
own next-but-one sum).  Each rank writes what it saw to OUT.<rank>.json.
"""

import json
import sys
import time

import numpy as np

from multigpu import backend
from multigpu.runtime import runtime as _runtime

run = _runtime.start()
comm = backend.get().Comm(run, sys.argv[2])
rank = comm.rank
host = not comm.__module__.startswith("multigpu.engine")  # (the engine sums torch tensors in its buffers)


def total(values: list[float]):
    """The sum's result as the collective returns it (the engine's: a view of its buffers)."""
    if host:
        return comm.reduce(np.asarray(values, np.float32), "summing a vector")
    import torch

    buf = comm.buffer(len(values))
    buf.copy_(torch.tensor(values))
    return comm.reduce(buf, what="summing a vector")


seen = {"transport": comm.transport, "sums_among": comm.sums_among, "rounds": []}
held = total([rank + 1.0, 0.0])  # (a run's first epoch sums over every rank)
seen["first"] = [float(v) for v in held]
for among, calls in (([0, 1], 3), ([1, 2], 2)):
    seen["formed"] = comm.form_subgroup(among)
    sums, late = [], None
    if rank in among:
        comm.among = among
        sums = [[float(v) for v in total([rank + 1.0, 10.0 * (rank + 1) + i])] for i in range(calls)]
        comm.among = None
    else:
        time.sleep(0.5)  # (the others sum among themselves meanwhile)
        late = [float(v) for v in held]
    held = total([rank + 1.0, 100.0])
    seen["rounds"].append({"among": sums, "late": late, "every": [float(v) for v in held]})
with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
    json.dump(seen, f)
