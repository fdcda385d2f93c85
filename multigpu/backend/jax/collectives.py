"""Collectives of a run on JAX: XLA's own, over a mesh of one device per process, and shared memory within a
machine.  Every error is fatal.

Each process holds one device of the global ``jax.devices()``.  A sum over
ranks puts every rank's vector in one row of a global array sharded over that
mesh and runs a compiled ``sum(axis=0)`` whose result is replicated: XLA does
the all-reduce (gloo on CPU).  Everything else (broadcast, gathering objects,
checks) is a sum of vectors where the other ranks send zeros.  Measured on
two processes on two cores of one machine: 4 ms for any vector up to 100,000 floats,
6.6 ms for 670,000 (torch's gloo: 2 and 4.8 ms).  Where every rank is a CPU
device of one x86-64 machine (``transport="auto"`` or ``"shm"``), float32 sums
(the step's, the initial weights') run through the shared-memory segment the
torch and TensorFlow backends use (:mod:`multigpu.engine.shm`, about 1.5 ms for
670,000 floats), the ranks agreeing on it through XLA's collectives and the
coordination service's barriers; the rest stays XLA's.
"""

from __future__ import annotations

import os
import pickle
import platform
from collections.abc import Sequence
from contextlib import contextmanager

import numpy as np

from multigpu import failure

__all__ = ["Comm"]

SLOT = 1024  # bytes per rank in the one sum of :meth:`Comm.gather_objects`


class Comm:
    """The collectives of one parallel run (JAX backend).

    Args:
        runtime: the run.
        transport: ``"auto"`` (shared memory for CPU devices of one x86-64
            machine, else XLA's gloo), ``"shm"`` or ``"gloo"``.
    """

    def __init__(self, runtime, transport: str = "auto") -> None:
        if transport not in ("auto", "shm", "gloo"):
            raise ValueError("On JAX, gradients are summed through shared memory (CPU devices of one machine) or by "
                             "XLA's gloo collectives: `transport` must be 'auto', 'shm' or 'gloo'. "
                             f"Received: transport={transport!r}")
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        self.runtime = runtime
        self.rank = runtime.rank
        self.world_size = runtime.world_size
        self.device = jax.local_devices()[0]
        self.transport = self._choose(transport, self.device.platform == "cpu")
        self._shm = self._part = None  # (the sums over part of the ranks: a segment of their own)
        if self.transport == "shm":
            from multigpu.engine.shm import SharedMemory

            self._shm = SharedMemory(self, runtime.timeout, _Agreement(self))
        mesh = Mesh(np.array(jax.devices()), ("ranks",))
        self._rows = NamedSharding(mesh, PartitionSpec("ranks"))
        self._sum = jax.jit(lambda a: a.sum(axis=0, dtype=a.dtype), out_shardings=NamedSharding(mesh, PartitionSpec()))
        self._gather = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))  # an all-gather
        self._met = False  # every rank reached the first collective (:meth:`_meet`)
        self._published = 0  # objects :meth:`publish` sent or took (the same count on every rank)

    def _choose(self, transport: str, cpu: bool) -> str:
        """Shared memory where every rank is a CPU device of one x86-64 machine (XLA's gloo sum of 670,000
        floats took 6.6 ms between two cores, the segment's about 1.5 ms; the MLP at batch 512 ran 16 ms a step
        with XLA's sums, 11.8 ms with the segment's: ``benchmarks/parking/``), else XLA's."""
        usable = (cpu and platform.machine().lower() in ("x86_64", "amd64") and self.runtime.same_host
                  and os.path.isdir("/dev/shm"))
        if transport == "shm" and not usable:
            raise ValueError("transport='shm' needs CPU devices on one x86-64 machine with /dev/shm. Received "
                             f"devices {[d.spec for d in self.runtime.devices]} on {platform.machine()}; use "
                             "transport='gloo'.")
        return ("shm" if usable else "gloo") if transport == "auto" else transport

    def _meet(self) -> None:
        """Before this process's first collective, every rank meets at the coordination service's barrier, for
        the run's timeout: XLA's CPU collectives set up their gloo context at the first one and wait only 30 s
        for the others there (ignoring ``--xla_cpu_collective_timeout_seconds``), and a rank on a fifth of a
        core could come later than that and end the run."""
        if self._met or self.world_size == 1:
            return
        from multigpu.backend.jax.group import coordination_client

        seconds = max(1, self.runtime.timeout)
        try:
            coordination_client().wait_at_barrier("multigpu/first-collective", int(seconds * 1000))
        except Exception as exc:
            if "timed out" not in str(exc).lower():
                raise
            failure.fail(f"another rank did not reach the first collective within {seconds:g} s (a rank on a "
                         f"small share of a core starts JAX slowly){failure.timeout_hint(seconds)}")
        self._met = True

    # ------------------------------------------------------- the group
    # A group that never shrinks (the backend is not elastic): every rank stays in it, rank 0 leads.
    leader = 0
    joining = False
    rejoined = False
    generation = 0
    min_devices = None  # (no run on JAX goes on without a lost device)
    alone = False  # the step's sums over this rank only: the others set aside (multigpu.backend.parking)
    among: list[int] | None = None  # the step's sums over these ranks only (the others set aside; shared memory)

    @property
    def sums_among(self) -> bool:
        """Whether the step's sums can run over part of the ranks: through shared memory (XLA's cannot)."""
        return self._shm is not None

    def form_subgroup(self, ranks) -> bool:
        """Every rank: the step's sums over ``ranks`` only, through a shared segment of their own; False with
        XLA's sums, which are over every rank."""
        if self._shm is None:
            return False
        from multigpu.engine.shm import SharedMemory

        with self.fatal("setting devices aside"):
            self._part = self._part or SharedMemory(self, self.runtime.timeout, _Agreement(self))
            self._part.reserve(self._shm.capacity)
        return True

    @property
    def members(self) -> list[int]:
        """Every rank (the group never shrinks)."""
        return list(range(self.world_size))

    @property
    def group_rank(self) -> int:
        """This rank's place in the group (its rank: the group never shrinks)."""
        return self.rank

    def on_regroup(self, listener) -> None:
        """Takes a listener for new groups of survivors, which this backend never forms."""

    # ------------------------------------------------------------- errors
    @contextmanager
    def fatal(self, what: str):
        """Any error in the block ends this rank, naming ``what`` failed."""
        try:
            yield
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            failure.fail(f"{what} failed: {type(exc).__name__}: {first}")

    # ------------------------------------------------------- the step's sum
    def reduce(self, vector, what: str = "summing gradients") -> np.ndarray:
        """The sum over ranks of a 1-D array (NumPy or JAX, on this process's device), as NumPy; alone (the
        other ranks set aside), the array itself: no collective."""
        import jax

        if self.alone:
            return np.array(vector)
        with self.fatal(what):
            among = self.among is not None and self._part is not None  # (over part of the ranks: any float)
            if self._shm is not None and (vector.dtype == np.float32 or among) and len(vector.shape) == 1:
                import torch

                host, shm = np.asarray(vector), self._part if among else self._shm
                buf = shm.buffer(host.size, torch.float32, part=among)
                buf.numpy()[:] = host
                out = shm.reduce(buf, host.size % 2039 + 1, None, self.among if among else None)
                return out.numpy().astype(host.dtype)  # (a copy: the segment is reused)
            self._meet()
            local = jax.device_put(vector, self.device).reshape(1, -1)
            rows = jax.make_array_from_single_device_arrays((self.world_size, local.shape[1]), self._rows,
                                                            [local])
            return np.asarray(self._sum(rows).addressable_data(0))

    def gather_rows(self, vector, width: int, what: str) -> np.ndarray:
        """Every rank's 1-D array (at most ``width`` long, padded to it) as the rows of one array: an
        all-gather, half the bytes of a sum of vectors that are zero where a rank wrote nothing."""
        import jax
        import jax.numpy as jnp

        with self.fatal(what):
            self._meet()
            local = jax.device_put(jnp.pad(vector, (0, width - vector.shape[0])), self.device).reshape(1, -1)
            rows = jax.make_array_from_single_device_arrays((self.world_size, width), self._rows, [local])
            return np.asarray(self._gather(rows).addressable_data(0))

    # ------------------------------------------------------- rare collectives
    def sum_floats(self, values: Sequence[float], what: str = "a collective") -> list[float]:
        """Sums a short list of floats over ranks (float32)."""
        return [float(v) for v in self.reduce(np.asarray(values, dtype=np.float32), what)]

    def broadcast(self, arrays: Sequence, src: int | None = None,
                  what: str = "broadcasting the initial weights") -> list:
        """Rank ``src``'s arrays on every rank (default: the leader's; NumPy arrays; one sum per dtype)."""
        src = self.leader if src is None else src
        arrays = [np.asarray(a) for a in arrays]
        out: list = [None] * len(arrays)
        by_dtype: dict = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype, []).append(i)
        for dtype, indices in by_dtype.items():
            flat = np.concatenate([arrays[i].reshape(-1) for i in indices]) if indices else np.zeros(0, dtype)
            if self.rank != src:
                flat = np.zeros_like(flat)
            if flat.dtype == np.bool_:
                total = self.reduce(flat.astype(np.int32), what).astype(np.bool_)
            else:
                total = self.reduce(flat, what).astype(dtype)
            offset = 0
            for i in indices:
                n = arrays[i].size
                out[i] = total[offset : offset + n].reshape(arrays[i].shape)
                offset += n
        return out

    def gather_objects(self, obj, what: str = "gathering results") -> list:
        """Every rank's ``obj``, in rank order: one sum where each fits in ``SLOT`` bytes (a length and the
        pickle in each rank's row; the judgment at an epoch's end, on every epoch), else two (lengths first)."""
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        rows = np.zeros((self.world_size, SLOT), dtype=np.uint8)
        head = data.size if data.size <= SLOT - 4 else 0xFFFFFFFF  # too long: everyone takes the two sums
        rows[self.rank, :4] = np.array([head], "<u4").view(np.uint8)
        if data.size <= SLOT - 4:
            rows[self.rank, 4 : 4 + data.size] = data
        rows = self.reduce(rows.reshape(-1), what).reshape(self.world_size, SLOT)
        heads = [int(rows[r, :4].copy().view("<u4")[0]) for r in range(self.world_size)]
        if all(h <= SLOT - 4 for h in heads):
            return [pickle.loads(rows[r, 4 : 4 + h].tobytes()) for r, h in enumerate(heads)]
        sizes = np.zeros(self.world_size, dtype=np.int32)
        sizes[self.rank] = data.size
        sizes = self.reduce(sizes, what)
        width = int(sizes.max())
        mine = np.zeros((self.world_size, width), dtype=np.uint8)
        mine[self.rank, : data.size] = data
        everyone = self.reduce(mine.reshape(-1), what).reshape(self.world_size, width)
        return [pickle.loads(everyone[r, : int(sizes[r])].tobytes()) for r in range(self.world_size)]

    def share(self, obj, src: int, what: str):
        """Rank ``src``'s ``obj`` (any picklable value) on every rank."""
        return self.gather_objects(obj if self.rank == src else None, what)[src]

    def publish(self, obj, src: int, what: str):
        """Rank ``src``'s ``obj`` on every rank, one way: ``src`` leaves it in the coordination service's store, a
        key per rank, and goes on; each other rank waits there for its own (the run's timeout), reads it and
        deletes it.  No collective: ``src`` waits for no one (a collective of XLA's cost the rank left 1 to 5 ms
        at every epoch's end while the others were set aside)."""
        from multigpu.backend.jax.group import coordination_client

        client = coordination_client()
        self._published += 1
        key = f"multigpu/published/{self._published}"
        with self.fatal(what):
            if self.rank == src:
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                for r in range(self.world_size):
                    if r != src:
                        client.key_value_set_bytes(f"{key}/{r}", data)
                return obj
            data = client.blocking_key_value_get_bytes(f"{key}/{self.rank}", int(max(1, self.runtime.timeout) * 1000))
            client.key_value_delete(f"{key}/{self.rank}")
            return pickle.loads(data)

    def post(self, key: str, obj) -> None:
        """Leaves ``obj`` under ``key`` in the coordination service's store (the newest replaces the one before),
        waiting for no rank."""
        from multigpu.backend.jax.group import coordination_client

        coordination_client().key_value_set_bytes(f"multigpu/board/{key}",
                                                  pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                                                  allow_overwrite=True)

    def peek(self, key: str):
        """The newest object :meth:`post` left under ``key``, or None where none was left yet (no wait)."""
        from multigpu.backend.jax.group import coordination_client

        try:
            data = coordination_client().key_value_try_get_bytes(f"multigpu/board/{key}")
        except Exception as exc:  # JAX's own error type, saying NOT_FOUND where nothing was posted yet
            if "NOT_FOUND" not in str(exc):
                raise
            return None
        return pickle.loads(data)

    def check_same(self, value: int, what: str) -> None:
        """Raises the same error on every rank when the ranks disagree on ``value`` (data lengths)."""
        values = np.zeros(self.world_size, dtype=np.int32)
        values[self.rank] = int(value)
        got = [int(v) for v in self.reduce(values, f"checking {what}")]
        if len(set(got)) > 1:
            detail = ", ".join(f"rank {r}: {v}" for r, v in enumerate(got))
            raise ValueError(f"The ranks received different data: {what} differ ({detail}). Every rank must "
                             "see the same data (build or load it the same way on every rank).")

    def shared_seed(self) -> int:
        """A random number rank 0 draws, the same on every rank."""
        seed = np.asarray([int.from_bytes(os.urandom(4), "little") >> 1], dtype=np.int32)
        return int(self.broadcast([seed], what="sharing a seed")[0][0])


class _Agreement:
    """How the ranks agree on a new shared-memory segment (:class:`multigpu.engine.shm.SharedMemory`'s ``setup``):
    through this run's XLA collectives and the coordination service's barriers."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.barriers = 0

    def largest(self, nbytes: int) -> int:
        return max(self.comm.gather_objects(int(nbytes), "preparing shared memory"))

    def name(self) -> int:
        mine = int.from_bytes(os.urandom(6), "little") if self.comm.rank == 0 else None
        return int(self.comm.share(mine, 0, "preparing shared memory"))

    def barrier(self) -> None:
        from multigpu.backend.jax.group import coordination_client

        self.barriers += 1
        coordination_client().wait_at_barrier(f"multigpu/shm/{self.barriers}",
                                              int(max(1, self.comm.runtime.timeout) * 1000))
