"""Where a rank sits on its machine, for the inputs that one machine reads once for all its ranks."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from multigpu.data.exchange import Pass, directory

__all__ = ["Host"]

_STREAMS: dict[tuple, itertools.count] = {}  # per call and rank: inputs read through the machine's files


@dataclass
class Host:
    """This rank's machine, as the input readers see it.

    Attributes:
        rank: the global rank.
        label: the rank and its device, for messages (``"rank 1 (CPU:1)"``).
        local_rank: this rank's index among the ranks of its machine.
        local_size: ranks on this machine.
        hosts: machines in the run.
        run: a name of the run shared by its ranks (the rendezvous port), which
            the supervisor uses to remove files a crashed run left.
        seed: the call's shared seed (``fit``, ``evaluate``, ``predict``), which names its files apart from
            those of any other call or of an earlier attempt of the run.
        comm: the run's collectives (for the checks that span machines).
    """

    rank: int
    label: str
    local_rank: int
    local_size: int
    hosts: int
    run: str
    seed: int
    comm: object = None

    @classmethod
    def of(cls, runtime, comm, seed: int) -> Host:
        """The host of this rank of ``runtime``."""
        where = runtime.environment
        if where is None:
            local_rank, local_size, run = 0, 1, "0"
        else:
            local_rank, local_size, run = where.local_rank, where.local_size, str(where.master_port)
        hosts = max(1, runtime.world_size // max(1, local_size))
        label = f"rank {runtime.rank} ({runtime.device.label})"
        return cls(runtime.rank, label, local_rank, local_size, hosts, run, seed, comm)

    @property
    def leader(self) -> int:
        """The global rank of this machine's local rank 0 (launchers number a machine's ranks in a row)."""
        return self.rank - self.local_rank

    def stream(self) -> str:
        """A new name for one input's passes (every rank creates its inputs in the same order)."""
        return str(next(_STREAMS.setdefault((self.run, self.seed, self.rank), itertools.count())))

    def open_pass(self, stream: str, number: int, depth: int, lost=()) -> Pass:
        """Pass ``number`` of input ``stream`` (``lost``: the machine's local ranks lost earlier in the run)."""
        prefix = os.path.join(directory(), f"multigpu-in-{self.run}-{self.seed:x}-h{self.leader}-s{stream}-p{number}")
        return Pass(prefix, self.local_rank, self.local_size, depth, lost)
