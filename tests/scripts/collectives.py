"""Every member of multigpu/backend/collectives.py's protocols, called on a real run of the backend in use.

    KERAS_BACKEND=jax multigpu run --devices cpu:0,cpu:1 collectives.py OUT [host_vectors] [elastic]

The members of the protocols named after OUT are called too.  Each rank writes what it saw to OUT.<rank>.json.
"""

import json
import sys
import time

import numpy as np

from multigpu import backend
from multigpu.backend.collectives import ElasticGroup, Group, HostVectors
from multigpu.runtime import runtime as _runtime

run = _runtime.start()
comm = backend.get().Comm(run, "auto")
rank = comm.rank
promised = sys.argv[2:]
seen = {"group": isinstance(comm, Group), "elastic": isinstance(comm, ElasticGroup),
        "host_vectors": isinstance(comm, HostVectors), "rank": rank, "world_size": comm.world_size,
        "transport": comm.transport, "leader": comm.leader, "joining": comm.joining, "rejoined": comm.rejoined,
        "sum_floats": comm.sum_floats([rank + 1.5, -rank], "summing floats"),
        "gather_objects": comm.gather_objects({"rank": rank, "text": "x" * (rank + 1)}),
        "gather_long": [len(t) for t in comm.gather_objects("y" * 2000 * (rank + 1))],  # beyond JAX's 1 KiB slots
        "seeds": comm.gather_objects(comm.shared_seed())}
comm.check_same(7, "a length")
try:
    comm.check_same(100 + rank, "the number of rows")
    seen["check_same"] = "no error"
except ValueError as exc:
    seen["check_same"] = str(exc)
with comm.fatal("a block that does not fail"):
    seen["fatal"] = "entered"
if "host_vectors" in promised:
    seen["reduce"] = comm.reduce(np.asarray([rank + 1, 2.5], np.float32), "summing a vector").tolist()
    seen["broadcast_leader"] = [a.tolist() for a in comm.broadcast([np.arange(3.0) * (rank + 1), np.int32([rank])])]
    seen["broadcast_1"] = [a.tolist() for a in comm.broadcast([np.arange(2.0) * (rank + 1)], src=1)]
if "elastic" in promised:
    seen["members"], seen["generation"] = list(comm.members), comm.generation
    seen["share"] = comm.share({"from": rank}, 1, "sharing an object")
seen["shared"] = comm.share({"from": rank}, 1, "sharing an object")
seen["published"] = [comm.publish({"from": rank, "n": n}, n % 2, "publishing an object") for n in range(3)]
# one way: the rank that publishes goes on while the other is still away
if rank == 0:
    time.sleep(1.0)
started = time.monotonic()
comm.publish({"late": True}, 1, "publishing an object")
seen["publish_seconds"] = time.monotonic() - started
# the board: nothing under a key before a post, then the newest post of any rank, on every rank
seen["peek_before"] = comm.peek("k")
comm.gather_objects(None)
if rank == 1:
    comm.post("k", {"n": 1})
    comm.post("k", {"n": 2, "a": np.arange(2.0)})
comm.gather_objects(None)
found = comm.peek("k")
seen["peeked"] = {"n": found["n"], "a": found["a"].tolist()}
comm.gather_objects(None)
if comm.__module__.startswith("multigpu.backend.jax"):  # each rank took its key from the store and deleted it
    from multigpu.backend.jax.group import coordination_client

    comm.gather_objects(None)  # (every rank is past its reads)
    seen["store_left"] = [k for k, _ in coordination_client().key_value_dir_get_bytes("multigpu/published/")]
else:  # torch.distributed's store, the same
    import torch.distributed as dist

    comm.gather_objects(None)
    store = dist.distributed_c10d._get_default_store()
    seen["store_left"] = [key for n in range(1, 5) for r in range(2)
                          if store.check([key := f"multigpu/published/{n}/{r}"])]
with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
    json.dump(seen, f)
