"""Sums over part of the ranks (devices set aside), then over every rank again, on a real run of the backend in use.

    KERAS_BACKEND=torch multigpu run --devices cpu:0,cpu:1,cpu:2 subgroups.py OUT TRANSPORT

Every rank sums, then ranks 0 and 1 sum among themselves three times while rank 2 waits, then every rank
sums; then ranks 1 and 2 twice, then every rank again.  Each rank writes what it saw to OUT.<rank>.json.
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


def total(values: list[float]) -> list[float]:
    if host:
        return [float(v) for v in comm.reduce(np.asarray(values, np.float32), "summing a vector")]
    buf = comm.buffer(len(values))
    buf.copy_(__import__("torch").tensor(values))
    return [float(v) for v in comm.reduce(buf, what="summing a vector")]


seen = {"transport": comm.transport, "sums_among": comm.sums_among, "rounds": [],
        "first": total([rank + 1.0, 0.0])}  # (a run's first epoch sums over every rank: shared memory is sized)
for among, calls in (([0, 1], 3), ([1, 2], 2)):
    seen["formed"] = comm.form_subgroup(among)
    sums = []
    if rank in among:
        comm.among = among
        sums = [total([rank + 1.0, 10.0 * (rank + 1) + i]) for i in range(calls)]
        comm.among = None
    else:
        time.sleep(0.5)  # (the others sum without this rank)
    comm.end_subgroup()
    seen["rounds"].append({"among": sums, "every": total([rank + 1.0, 100.0])})
with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
    json.dump(seen, f)
