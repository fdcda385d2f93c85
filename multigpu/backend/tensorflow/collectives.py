"""Collectives of a run on TensorFlow: the engine's (:mod:`multigpu.engine`), on NumPy arrays.  Every error is fatal.

A TensorFlow step hands its vector over as a NumPy array (a GPU's values come
to the host once); it is copied into the engine's buffer (shared memory
between ranks of one machine, else a gloo all-reduce) and the sum comes back
as NumPy.  The rare collectives (broadcast, gathering objects, checks) are
the engine's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from multigpu.engine.comm import Comm as _Engine
from multigpu.membership import PeerLostError

__all__ = ["Comm"]

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Comm:
    """The collectives of one parallel run (TensorFlow backend).

    Args:
        runtime: the run.
        transport: ``"shm"``, ``"gloo"`` or ``"auto"`` (shared memory between
            ranks of one x86-64 machine, else gloo).
    """

    def __init__(self, runtime, transport: str = "auto") -> None:
        self.engine = _Engine(runtime, transport, vectors="host")
        self.runtime = runtime
        self.rank = runtime.rank
        self.world_size = runtime.world_size
        self.transport = self.engine.transport
        self.fatal = self.engine.fatal
        self._lost: PeerLostError | None = None  # a loss met by a sum called from a TensorFlow function

    # ------------------------------------------------------- the group (the engine's)
    @property
    def leader(self) -> int:
        """The rank that writes, logs and saves: rank 0, or the lowest one left after rank 0 was lost."""
        return self.engine.leader

    @property
    def members(self) -> list[int]:
        return self.engine.members

    @property
    def generation(self) -> int:
        return self.engine.generation

    @property
    def min_devices(self) -> int | None:
        return self.engine.min_devices

    @min_devices.setter
    def min_devices(self, value: int | None) -> None:
        self.engine.min_devices = value

    @property
    def alone(self) -> bool:
        """Whether this rank's step sums are over itself alone (the others set aside)."""
        return self.engine.alone

    @alone.setter
    def alone(self, value: bool) -> None:
        self.engine.alone = value

    @property
    def among(self) -> list[int] | None:
        """The ranks this rank's step sums are over while the others are set aside (None: every rank)."""
        return self.engine.among

    @among.setter
    def among(self, value: list[int] | None) -> None:
        self.engine.among = value

    sums_among = True

    def form_subgroup(self, ranks) -> bool:
        return self.engine.form_subgroup(ranks)

    @property
    def joining(self) -> bool:
        return self.engine.joining

    @property
    def rejoined(self) -> bool:
        return self.engine.rejoined

    def on_regroup(self, listener) -> None:
        """Calls ``listener(members)`` after each new group of survivors (the shares drop the lost devices)."""
        self.engine.on_regroup(listener)

    def regroup(self, members) -> None:
        self.engine.regroup(members)

    def join_waiting(self) -> bool:
        return self.engine.join_waiting()

    def rejoin(self):
        return self.engine.rejoin()

    def welcome(self, message):
        return self.engine.welcome(message)

    def share(self, obj, src: int, what: str):
        return self.engine.share(obj, src, what)

    def publish(self, obj, src: int, what: str):
        return self.engine.publish(obj, src, what)

    def post(self, key: str, obj) -> None:
        self.engine.post(key, obj)

    def peek(self, key: str):
        return self.engine.peek(key)

    def take_lost(self) -> PeerLostError | None:
        """The loss a sum met inside a TensorFlow function (where TensorFlow wraps the error), once."""
        lost, self._lost = self._lost, None
        return lost

    def reduce(self, vector, what: str = "summing gradients") -> np.ndarray:
        """The sum over ranks of a 1-D float32, float16 or bfloat16 array, as NumPy of the same dtype (valid
        until the next-but-one call)."""
        vector = np.asarray(vector).reshape(-1)
        dtype = _TORCH.get(vector.dtype.name)
        if dtype is None:
            raise TypeError(f"multigpu sums float32, float16 or bfloat16 vectors. Received: {vector.dtype}")
        buf = self.engine.buffer(vector.size, dtype)
        if dtype == torch.bfloat16:  # NumPy has no bfloat16 of torch's: the bits travel as int16
            buf.view(torch.int16).numpy()[:] = vector.view(np.int16)
        else:
            buf.numpy()[:] = vector
        summed = self._reduce(buf, what, lambda: f"{vector.size} {vector.dtype} values")
        if dtype == torch.bfloat16:
            return summed.view(torch.int16).numpy().view(vector.dtype)
        return summed.numpy()

    def reduce_parts(self, parts: Sequence[np.ndarray], what: str = "summing gradients") -> np.ndarray:
        """The sum over ranks of float32 ``parts`` laid end to end, each written straight into the engine's
        buffer (no joined copy first), as one float32 NumPy vector (valid until the next-but-one call)."""
        sizes = [int(np.size(p)) for p in parts]
        n = sum(sizes)
        buf = self.engine.buffer(n, torch.float32)
        flat, start = buf.numpy(), 0
        for part, size in zip(parts, sizes):
            flat[start : start + size] = np.reshape(part, -1)
            start += size
        return self._reduce(buf, what, lambda: f"{n} float32 values").numpy()

    def _reduce(self, buf: torch.Tensor, what: str, describe) -> torch.Tensor:
        try:
            return self.engine.reduce(buf, what=what, describe=describe)
        except PeerLostError as lost:
            self._lost = lost  # the group of the ranks left is formed: the step is taken again over them
            raise

    def gather_parts(self, mine: Sequence[np.ndarray], where: Sequence[int], n: int, what: str) -> np.ndarray:
        """A float32 vector of ``n`` values whose every part one rank writes: this rank's arrays ``mine``, each
        at its offset in ``where``, the others' from them (on shared memory each rank writes straight into the
        result; elsewhere a sum with zeros).  Returns the whole vector (valid until the next-but-one call)."""
        buf = self.engine.buffer(n, torch.float32, disjoint=True)
        flat = buf.numpy()
        for start, values in zip(where, mine):
            flat[start : start + values.size] = values.reshape(-1)
        return self._reduce(buf, what, lambda: f"{what} ({n} float32 values)").numpy()

    def concatenate(self, arrays: Sequence[np.ndarray], what: str = "gathering sparse gradients") -> list:
        """Every rank's arrays joined along their first axis, in rank order (each array on its own).

        Two sums: the ranks' row counts, then one vector where each rank
        writes its rows at its place and zeros elsewhere, so the sum is the
        concatenation, bit for bit.  Values travel as float32: integers
        (row indices) up to 2**24 are exact.

        Args:
            arrays: this rank's arrays; the same number, trailing shapes and dtypes on every rank.
            what: what is being gathered, for error messages.
        """
        arrays = [np.asarray(a) for a in arrays]
        counts = np.zeros((self.world_size, len(arrays)), np.float32)
        counts[self.rank] = [a.shape[0] for a in arrays]
        counts = self.reduce(counts.reshape(-1), what).reshape(self.world_size, len(arrays)).astype(np.int64)
        widths = [int(np.prod(a.shape[1:])) for a in arrays]
        totals = [int(counts[:, i].sum()) * w for i, w in enumerate(widths)]
        vector = np.zeros(sum(totals), np.float32)
        start = 0
        for i, (a, w) in enumerate(zip(arrays, widths)):
            mine = start + int(counts[: self.rank, i].sum()) * w
            vector[mine : mine + a.size] = a.reshape(-1)
            start += totals[i]
        summed = self.reduce(vector, what)
        out, start = [], 0
        for a, total in zip(arrays, totals):
            out.append(summed[start : start + total].reshape(-1, *a.shape[1:]).astype(a.dtype))
            start += total
        return out

    def sum_floats(self, values: Sequence[float], what: str = "a collective") -> list[float]:
        """Sums a short list of floats over ranks (float64)."""
        return self.engine.sum_floats(values, what)

    def broadcast(self, arrays: Sequence, src: int | None = None,
                  what: str = "broadcasting the initial weights") -> list:
        """Rank ``src``'s arrays on every rank, by default the leader's (NumPy arrays in, NumPy arrays out)."""
        tensors = [torch.from_numpy(np.array(a, copy=True).reshape(np.shape(a))) for a in arrays]
        self.engine.broadcast(tensors, src, what)
        return [t.numpy() for t in tensors]

    def gather_objects(self, obj, what: str = "gathering results") -> list:
        """Every rank's ``obj``, in rank order."""
        return self.engine.gather_objects(obj, what)

    def check_same(self, value: int, what: str) -> None:
        """Raises the same error on every rank when the ranks disagree on ``value`` (data lengths)."""
        self.engine.check_same(value, what)

    def shared_seed(self) -> int:
        """A random number rank 0 draws, the same on every rank."""
        return self.engine.shared_seed()
