"""Messages through the run's store (the key-value store of torch.distributed's rendezvous) that the sender does
not wait on.

A collective waits for every rank of its group: while devices are set aside
(:mod:`multigpu.backend.parking`), a message from the rank left to the ranks set
aside would make it wait for them at every epoch's end, and a device set aside
for being slow (a tenth of a core, a host behind a slow link) answers late.
Here the sender leaves the message in the store and goes on; each reader takes
its own copy when it gets there.
"""

from __future__ import annotations

import datetime
import pickle

import torch.distributed as dist

__all__ = ["Board"]


class Board:
    """The store's messages of a :class:`~multigpu.engine.comm.Comm` (a base class: it holds ``rank``,
    ``members``, ``runtime`` and ``fatal``)."""

    _published = 0  # messages published so far (every rank counts the same ones)

    def post(self, key: str, obj) -> None:
        """``obj`` under ``key`` in the run's store (rank 0 serves it), replacing the one before; no rank waits."""
        _store().set(f"multigpu/board/{key}", pickle.dumps(obj, protocol=5))

    def peek(self, key: str):
        """The newest object :meth:`post` left under ``key``, or None (no wait)."""
        store, name = _store(), f"multigpu/board/{key}"
        return pickle.loads(store.get(name)) if store.check([name]) else None

    def publish(self, obj, src: int, what: str):
        """Rank ``src``'s ``obj`` on every rank of the group, one way: ``src`` leaves a copy for each other rank
        in the store and goes on; each of them waits for its own (the run's timeout), reads it and deletes it."""
        self._published += 1
        key = f"multigpu/published/{self._published}"
        store = _store()
        with self.fatal(what):
            if self.rank == src:
                data = pickle.dumps(obj, protocol=5)
                for r in self.members:
                    if r != src:
                        store.set(f"{key}/{r}", data)
                return obj
            mine = f"{key}/{self.rank}"
            store.wait([mine], datetime.timedelta(seconds=max(1.0, self.runtime.timeout)))
            data = store.get(mine)
            store.delete_key(mine)
            return pickle.loads(data)


def _store():
    return dist.distributed_c10d._get_default_store()
