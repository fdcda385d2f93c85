"""The collectives a backend's ``Comm`` offers the code above it, declared once.

Three classes implement them: the engine's (:mod:`multigpu.engine.comm`,
which the torch backend uses as it is), TensorFlow's (the engine's, on NumPy
arrays) and JAX's (XLA's all-reduces).  The neutral layers (``keras/``,
``data/``, ``balancing/`` through the model, ``backend/recovery.py``,
``backend/steps.py``, ``api.py``) reach a run's collectives only through
these members, with these signatures; ``tests/test_collectives.py`` checks
every class against them, by signature and on a real two-rank run of each
backend.

* :class:`Group`: every backend.
* :class:`ElasticGroup`: a backend whose group can leave a lost rank behind
  and take a restarted one back (``Facts.elastic``: torch and TensorFlow),
  for :class:`~multigpu.backend.recovery.Recovery`.
* :class:`HostVectors`: a backend whose step hands its sums over as NumPy
  arrays (TensorFlow, JAX; :class:`~multigpu.backend.steps.StepsCore` uses
  them there).  The torch backend sums torch tensors in the engine's buffers
  instead (``buffer`` and ``reduce(buf, ...)``, its own step's business).

Every collective is fatal on error, naming ``what`` failed; where a peer is
lost in a run that may shrink, it raises
:class:`~multigpu.membership.PeerLostError` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["ElasticGroup", "Group", "HostVectors"]


@runtime_checkable
class Group(Protocol):
    """The members every backend's ``Comm`` has.

    Attributes:
        rank: this process's rank.
        world_size: the number of ranks the run started with.
        transport: how the step's sums travel: ``"shm"``, ``"gloo"`` or ``"nccl"``.
        runtime: the run (:class:`multigpu.runtime.runtime.Runtime`).
        alone: whether this rank's step sums are over itself only (the other ranks set aside,
            :mod:`multigpu.backend.parking`): they are then no collective.
        among: the ranks this rank's step sums are over while the others are set aside and more than one
            rank is left (None: every rank), readied by :meth:`form_subgroup`.
        sums_among: whether the step's sums can run over part of the ranks (JAX's XLA sums cannot).
    """

    rank: int
    world_size: int
    transport: str
    runtime: Any
    alone: bool
    among: list[int] | None
    sums_among: bool

    @property
    def leader(self) -> int:
        """The rank that writes, logs and saves: rank 0, or the lowest one left after it was lost."""

    @property
    def joining(self) -> bool:
        """Whether this process is a restarted rank that has not joined the others yet."""

    @property
    def rejoined(self) -> bool:
        """Whether this process joined a run under way (a restarted rank)."""

    def fatal(self, what: str) -> AbstractContextManager:
        """A block whose any error ends this rank, naming ``what`` failed."""

    def on_regroup(self, listener: Callable[[list[int]], None]) -> None:
        """Calls ``listener(members)`` after each new group of survivors (never, where the group cannot shrink)."""

    def form_subgroup(self, ranks: list[int]) -> bool:
        """Every rank: readies the step's sums over ``ranks`` only (:attr:`among`); False where they cannot."""

    def sum_floats(self, values: Sequence[float], what: str = "a collective") -> list[float]:
        """The sum over ranks of a short list of floats (float64 on the engine, float32 on JAX)."""

    def gather_objects(self, obj: Any, what: str = "gathering results") -> list:
        """Every rank's ``obj``, in rank order."""

    def check_same(self, value: int, what: str) -> None:
        """Raises the same ``ValueError`` on every rank when the ranks disagree on ``value``."""

    def shared_seed(self) -> int:
        """A random number the leader draws, the same on every rank."""

    @property
    def members(self) -> list[int]:
        """The ranks in the group now, in order (every rank, where the group cannot shrink)."""

    def share(self, obj: Any, src: int, what: str) -> Any:
        """Rank ``src``'s ``obj`` (any picklable value) on every rank."""

    def publish(self, obj: Any, src: int, what: str) -> Any:
        """Rank ``src``'s ``obj`` on every rank, one way: ``src`` leaves a copy for each other rank in the run's
        store (torch.distributed's, JAX's coordination service) and goes on; each takes its own when it gets
        there (the run's timeout)."""

    def post(self, key: str, obj: Any) -> None:
        """Leaves ``obj`` (picklable) under ``key`` in the run's store, the newest replacing the one before,
        waiting for no rank (torch.distributed's store, JAX's coordination service)."""

    def peek(self, key: str) -> Any:
        """The newest object :meth:`post` left under ``key`` by any rank, or None where none was yet (no wait)."""


@runtime_checkable
class ElasticGroup(Group, Protocol):
    """A group that goes on without a lost rank and takes a restarted one back (``Facts.elastic``)."""

    min_devices: int | None

    @property
    def generation(self) -> int:
        """How many groups of survivors were formed so far."""

    def regroup(self, members: list[int]) -> None:
        """Forms the group of ``members`` (the ranks left)."""

    def join_waiting(self) -> bool:
        """Whether a restarted rank waits to join (read by every rank at the same step)."""

    def rejoin(self) -> Any:
        """A restarted rank: joins the run under way; returns the survivors' welcome."""

    def welcome(self, message: Any) -> Any:
        """The survivors: let the waiting ranks in and hand them ``message``."""


@runtime_checkable
class HostVectors(Protocol):
    """Sums of NumPy vectors, for a backend whose step hands them over on the host."""

    def reduce(self, vector: np.ndarray, what: str = "summing gradients") -> np.ndarray:
        """The sum over ranks of a 1-D float vector, as NumPy of the same dtype."""

    def broadcast(self, arrays: Sequence[np.ndarray], src: int | None = None,
                  what: str = "broadcasting the initial weights") -> list[np.ndarray]:
        """Rank ``src``'s arrays on every rank (None: the leader's), NumPy in and out."""
