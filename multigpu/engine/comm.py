"""The collectives of a run on torch.distributed, for the torch and TensorFlow backends.  Every error is fatal.

:class:`Comm` is all the communication multigpu does: the per-step sum of
gradients and extras (:meth:`Comm.buffer` then :meth:`Comm.reduce`), and a few
rare ones (broadcast of the initial weights, gathering predictions, checking
that ranks agree on data lengths).  A collective that fails or times out ends
the rank through :func:`multigpu.failure.fail`: the process group it broke is
never used again, and the supervisor ends the run.

The per-step sum has two transports:

* ``gloo`` (NCCL on GPUs): ``torch.distributed.all_reduce``;
* ``shm``, for ranks on one x86-64 machine whose vectors are in host memory:
  every rank writes its vector into a shared-memory segment, each sums one
  chunk of all of them, and all read the result (:mod:`multigpu.engine.shm`).

The torch backend sums torch tensors on each rank's device; the TensorFlow
backend hands NumPy arrays, which live in host memory (``vectors="host"``).
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from multigpu import env, failure, membership
from multigpu.engine.board import Board
from multigpu.engine.group import process_group_backend
from multigpu.engine.shm import DTYPES as _SHM_DTYPES
from multigpu.engine.shm import CollectiveMismatchError, SharedMemory
from multigpu.membership import PeerLostError

__all__ = ["BROADCAST_BUCKET", "CollectiveMismatchError", "Comm"]

BROADCAST_BUCKET = 4 << 20  # bytes: a broadcast's flat copies hold at most this (larger tensors go in place)


class Comm(Board):
    """The collectives of one parallel run.

    Args:
        runtime: the run.
        transport: ``"shm"``, ``"gloo"`` or ``"auto"`` (shared memory for ranks
            on one x86-64 machine whose vectors are in host memory, else the
            process group's).
        vectors: where the caller's vectors live: ``"device"`` (each rank's
            device: a GPU rank sums on its GPU) or ``"host"`` (a framework that
            hands NumPy arrays, whatever its devices: shared memory then serves
            GPU ranks of one machine too).
    """

    def __init__(self, runtime, transport: str = "auto", vectors: str = "device") -> None:
        if vectors not in ("device", "host"):
            raise ValueError(f"`vectors` must be 'device' or 'host'. Received: vectors={vectors!r}")
        self.runtime = runtime
        self.rank = runtime.rank
        self.world_size = runtime.world_size
        # The ranks still in the run (all but lost ones) and this rank's place among them: the process group's.
        self.members: list[int] = list(range(self.world_size))
        self.generation = 0
        self.min_devices: int | None = None  # set by a run that may go on without a lost device
        self.joining = env.get(env.REJOIN) == "1"  # a lost rank started again, in no group until rejoin()
        self.rejoined = False  # this process came back: its first step takes the others' state
        self._on_regroup: list[Callable[[membership.Members], None]] = []
        self.host = vectors == "host"
        cuda = runtime.device.is_cuda and not self.host
        self.device = torch.device(f"cuda:{runtime.device.index}") if cuda else torch.device("cpu")
        self._buffers: dict[tuple, torch.Tensor] = {}
        # Devices set aside (backend/parking.py): sums over this rank alone (no collective), or ``among`` the ranks left
        self.alone = False
        self.among: list[int] | None = None
        self._subgroups: dict[tuple[int, ...], object] = {}  # the process group's own, by ranks (gloo, NCCL)
        self._shm: SharedMemory | None = None
        self._part: SharedMemory | None = None  # the sums over part of the ranks, through a segment of their own
        self.transport = self._choose(transport)
        if self.transport == "shm":
            self._shm = SharedMemory(self, runtime.timeout)

    def _choose(self, transport: str) -> str:
        if transport not in ("auto", "shm", "gloo"):
            raise ValueError(f"`transport` must be 'auto', 'shm' or 'gloo'. Received: transport={transport!r}")
        cpu = self.host or all(not d.is_cuda for d in self.runtime.devices)
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        usable = cpu and x86 and self.runtime.same_host and os.path.isdir("/dev/shm")
        if transport == "shm" and not usable:
            raise ValueError(
                f"transport='shm' needs {'' if self.host else 'CPU '}devices on one x86-64 machine with "
                f"/dev/shm. Received devices {[d.spec for d in self.runtime.devices]} on {platform.machine()}; "
                "use transport='gloo'."
            )
        if transport == "auto":
            return "shm" if usable else "gloo"
        return transport

    # ------------------------------------------------------------- members
    sums_among = True  # the step's sums can run over part of the ranks (:meth:`form_subgroup`)

    def form_subgroup(self, ranks: Sequence[int]) -> bool:
        """Every rank, before the others are set aside: the step's sums over ``ranks`` only (:attr:`among`),
        through a shared segment of their own or a subgroup of the process group's own."""
        key = tuple(ranks)
        with self.fatal("forming the group of the ranks left"):
            if self._shm is not None:
                self._part = self._part or SharedMemory(self, self.runtime.timeout)
                self._part.reserve(self._shm.capacity)
            elif key not in self._subgroups:
                self._subgroups[key] = dist.new_group(list(key))
        return True

    @property
    def group_rank(self) -> int:
        """This rank's place in the process group (its rank, until a device is lost)."""
        return self.members.index(self.rank)

    @property
    def leader(self) -> int:
        """The rank that writes, logs and saves: rank 0, or the lowest one left after rank 0 was lost."""
        return self.members[0]

    def on_regroup(self, listener: Callable[[membership.Members], None]) -> None:
        """Calls ``listener(members)`` after each new group of survivors (the shares drop the lost devices)."""
        self._on_regroup.append(listener)

    def _peer_lost(self) -> membership.Members | None:
        """The new record of members if a peer was lost (waits for the supervisor's word for a moment)."""
        if self.min_devices is None:
            return None
        return membership.await_change(env.get(env.RUN_DIR), self.generation, membership.LOST_AFTER + 2.0)

    def regroup(self, members: membership.Members) -> None:
        """Leaves the process group and forms the one of ``members`` (a new generation: the ranks left after a
        loss, or the ranks in the run with those coming back).

        The engine's own group again: gloo (or NCCL) over a file store in the
        run's folder, named by generation, so that no rank meets a process
        of the old group.
        """
        if members.generation <= self.generation:
            return
        before = list(self.members)
        if not self.joining:
            try:
                dist.destroy_process_group()
            except Exception:  # pragma: no cover - a group broken beyond its own cleanup
                pass
        self.members, self.generation, self.joining = list(members.members), members.generation, False
        if self.rank not in self.members:
            failure.fail("the supervisor declared this rank lost")
        run_dir = env.get(env.RUN_DIR)
        store = dist.FileStore(os.path.join(run_dir, f"store-{members.generation}"), len(self.members))
        kwargs = {}
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device
        try:
            dist.init_process_group(self._group_backend, store=store, rank=self.group_rank,
                                    world_size=len(self.members),
                                    timeout=datetime.timedelta(seconds=self.runtime.timeout), **kwargs)
        except Exception as exc:
            failure.fail(f"could not form a group of ranks {self.members} (before: {before}): "
                         f"{type(exc).__name__}: {exc}")
        if self._shm is not None:
            self._shm, self._part = SharedMemory(self, self.runtime.timeout), None
        for listener in self._on_regroup:
            listener(members)

    def join_waiting(self) -> bool:
        """Whether the record (as the heartbeat thread last read it) counts ranks coming back that are not in
        this group yet."""
        found = membership.latest()
        return found is not None and found.generation > self.generation and bool(found.newcomers(self.members))

    def rejoin(self):
        """On a lost rank started again: says it is ready, waits until the others form a group with it, and
        returns what the leader sends (:meth:`welcome`)."""
        run_dir = env.get(env.RUN_DIR)
        membership.say_ready(self.rank)
        while True:
            found = membership.read(run_dir)
            if found is not None and self.rank in found.members:
                break
            time.sleep(0.02)
        membership.await_welcome(run_dir, found.generation)
        self.regroup(found)
        self.rejoined = True
        return self.welcome(None)

    def welcome(self, message):
        """The leader's ``message`` on every rank of the group (the run's position, for ranks coming back)."""
        return self.share(message, self.leader, "welcoming the ranks that came back")

    def share(self, obj, src: int, what: str):
        """Rank ``src``'s ``obj`` (any picklable value) on every rank of the group."""
        box = [obj]
        with self.fatal(what):
            dist.broadcast_object_list(box, src=self.members.index(src))
        return box[0]

    @property
    def _group_backend(self) -> str:
        """The backend of the run's first group (:func:`~multigpu.engine.group.process_group_backend`), for
        every later one: each rank must name the same (a GPU rank beside a CPU one is on gloo too)."""
        return process_group_backend(self.runtime)

    def _lost_or_fail(self, what: str, exc: Exception) -> None:
        """After a collective failed: :class:`PeerLostError` when a peer was lost and the run goes on, else the end."""
        members = self._peer_lost()
        if members is not None:
            self.regroup(members)
            raise PeerLostError(members) from None
        first = str(exc).splitlines()[0] if str(exc) else ""
        if "Timed out waiting" in first:  # gloo's timeout: say it the way the shared-memory path does
            first = (f"another rank did not reach the collective within {self.runtime.timeout:g} s "
                     f"(gloo: {first.rsplit('] ', 1)[-1]})")
            failure.fail(f"{what} failed: TimeoutError: {first}{failure.timeout_hint(self.runtime.timeout)}")
        hint = failure.timeout_hint(self.runtime.timeout) if isinstance(exc, TimeoutError) else ""
        failure.fail(f"{what} failed: {type(exc).__name__}: {first}{hint}")

    def _again_after_loss(self, call: Callable[[], object]):
        """``call()``, made again over the survivors when a peer is lost during it (for collectives whose
        inputs do not depend on who is in the run)."""
        if self.joining:
            failure.fail("a lost rank started again takes part from its script's fit() on: this script calls "
                         "evaluate(), predict() or a save on the parallel model before fit(), which the ranks in "
                         "the run made long ago")
        while True:
            try:
                return call()
            except PeerLostError:
                continue

    # ------------------------------------------------------------- errors
    @contextmanager
    def fatal(self, what: str):
        """Any error in the block ends this rank, naming ``what`` failed (or, in a run that goes on without a
        lost peer, forms the group of the survivors and raises :class:`PeerLostError`)."""
        try:
            yield
        except (CollectiveMismatchError, PeerLostError) as exc:
            if isinstance(exc, PeerLostError):
                self.regroup(exc.members)
                raise
            failure.fail(str(exc))
        except Exception as exc:
            self._lost_or_fail(what, exc)

    # ------------------------------------------------------- the step's sum
    def buffer(self, n: int, dtype: torch.dtype = torch.float32, *, disjoint: bool = False) -> torch.Tensor:
        """A vector of ``n`` elements to fill for the next :meth:`reduce` (contents undefined).

        With ``disjoint``, every element is written by exactly one rank and the sum only gathers them: on
        shared memory each rank writes straight into the result, which nobody adds up; elsewhere the vector
        comes zeroed, for a sum that leaves each element as its writer wrote it.
        """
        shm = self._shm if self.among is None else self._part
        if shm is not None and dtype in _SHM_DTYPES and not self.alone:
            with self.fatal("preparing shared memory"):
                return shm.buffer(n, dtype, disjoint, part=self.among is not None)
        key = (n, dtype)  # (alone: a private buffer, summed in place as gloo sums it)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(n, dtype=dtype, device=self.device)
        return buf.zero_() if disjoint else buf

    def calls(self) -> int:
        """How many sums ran through shared memory so far (0 elsewhere): their parity says which of its two sets
        of buffers the next one writes."""
        return 0 if self._shm is None else self._shm.seq

    def reduce(self, buf: torch.Tensor, *, tag: int = 0, what: str = "summing gradients",
               describe: Callable[[], str] | None = None) -> torch.Tensor:
        """The sum over ranks of ``buf`` (a vector from :meth:`buffer`).

        Args:
            buf: this rank's vector.
            tag: a number standing for the vector's layout; ranks that pass
                different tags (or sizes) get an error naming both.
            what: what is being summed, for error messages.
            describe: the layout in words, for the mismatch message.

        Returns:
            The sum; valid until the next-but-one call.
        """
        if self.alone:
            return buf  # the sum over this rank alone
        with self.fatal(what):
            if self._shm is not None and self._shm.owns(buf):
                out = self._shm.reduce(buf, tag, describe)
            elif self.among is not None and self._part is not None and self._part.owns(buf):
                out = self._part.reduce(buf, tag, describe, [self.members.index(r) for r in self.among])
            else:
                membership.at("sum", self.rank)
                group = None if self.among is None else self._subgroups[tuple(self.among)]
                dist.all_reduce(buf, group=group)
                out = buf
            if membership.dropped("sum", self.rank):
                raise ConnectionError("the sum's result was thrown away (MULTIGPU_FAULT sum/drop)")
            return out

    # ------------------------------------------------------- rare collectives
    def sum_floats(self, values: Sequence[float], what: str = "a collective") -> list[float]:
        """Sums a short list of floats over ranks (float64)."""
        def call() -> list[float]:
            t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
            with self.fatal(what):
                dist.all_reduce(t)
            return t.tolist()
        return self._again_after_loss(call)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int | None = None,
                  what: str = "broadcasting the initial weights") -> None:
        """Copies rank ``src``'s tensors (default: the leader's, which is also used once ``src`` is lost) into
        every rank's: a tensor of :data:`BROADCAST_BUCKET` bytes or more in place, smaller ones of a dtype
        together through one flat copy of at most that size (so a broadcast never holds a second copy of the
        weights: a device with room for the training state has room for it)."""
        buckets: list[list[torch.Tensor]] = []
        open_: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
        for t in tensors:
            size = t.numel() * t.element_size()
            if size >= BROADCAST_BUCKET:
                buckets.append([t])
                continue
            group, used = open_.setdefault(t.dtype, ([], [0]))
            if used[0] + size > BROADCAST_BUCKET:
                buckets.append(list(group))
                group.clear()
                used[0] = 0
            group.append(t)
            used[0] += size
        buckets += [group for group, _ in open_.values() if group]

        def call() -> None:
            origin = self.members.index(src if src is not None and src in self.members else self.leader)
            with self.fatal(what), torch.no_grad():
                for group in buckets:
                    t = group[0]
                    if len(group) == 1 and t.is_contiguous() and t.device == self.device:
                        dist.broadcast(t.detach(), origin)
                        continue
                    flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self.device)
                    dist.broadcast(flat, origin)
                    offset = 0
                    for t in group:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()
        self._again_after_loss(call)

    def gather_objects(self, obj, what: str = "gathering results") -> list:
        """Every rank's ``obj``, in rank order (None for a lost rank)."""
        def call() -> list:
            got: list = [None] * len(self.members)
            with self.fatal(what):
                dist.all_gather_object(got, obj)
            by_rank = dict(zip(self.members, got))
            return [by_rank.get(r) for r in range(self.world_size)]
        return self._again_after_loss(call)

    def check_same(self, value: int, what: str) -> None:
        """Raises the same error on every rank when the ranks disagree on ``value`` (data lengths: ranks that
        disagree would take different numbers of steps and wait for each other until the timeout)."""
        def call() -> list[int]:
            values = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
            values[self.rank] = int(value)
            with self.fatal(f"checking {what}"):
                dist.all_reduce(values)
            return [int(values[r]) for r in self.members]
        got = self._again_after_loss(call)
        if len(set(got)) > 1:
            detail = ", ".join(f"rank {r}: {v}" for r, v in zip(self.members, got))
            raise ValueError(f"The ranks received different data: {what} differ ({detail}). Every rank must "
                             "see the same data (build or load it the same way on every rank).")

    def shared_seed(self) -> int:
        """A random number the leader draws, the same on every rank."""
        def call() -> int:
            seed = torch.tensor([int.from_bytes(os.urandom(4), "little") >> 1], dtype=torch.int64,
                                device=self.device)
            with self.fatal("sharing a seed"):
                dist.broadcast(seed, 0)
            return int(seed.item())
        return self._again_after_loss(call)
