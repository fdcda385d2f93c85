"""The memory policy of every backend: what a step needs, the largest local batch that fits, a step that ran out.

A backend only measures, through a :class:`MemoryProbe`: a GPU's allocator
statistics (torch's CUDA probe), or, on a CPU device given a memory size
(``cpu:0/2GiB``), the process's memory (:class:`ProcessMemory`, the same on
every backend).  The rest is here, the same on torch, TensorFlow and JAX.

**Measured.** A few steps at each local batch size (after its first two,
which warm caches, trace or record the pass) are measured: the peak above
what the device held before the step, and the memory left.
:class:`~multigpu.balancing.memory.RowMemory` turns them into a cap, which
the rank sends in its step's message (:mod:`multigpu.backend.message`),
so every rank plans the next batches within it.

**Ran out.** A rank whose forward or backward pass fails to allocate (a
GPU's out-of-memory error, TensorFlow's ``ResourceExhaustedError``, the CPU
allocator's ``can't allocate memory``, a ``MemoryError``) frees what the pass
held and goes on to the step's one sum with no gradients, saying how many
rows it could not hold.  Every rank reads the same sum, so every rank sees it
at once, before any weight changed: none applies the step, and no rank hangs.
With automatic shares the device's cap is lowered, the same global batch is
planned and cut again, and the step taken again
(:mod:`multigpu.backend.driver`), exactly as one device would take it; only a
global batch the devices cannot hold together ends the run, naming each
device's cap.  Fixed ratios are the user's: a device they give more rows
than it holds ends the run, naming the device, its memory and the share that
fits.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from multigpu import failure
from multigpu.balancing.memory import RowMemory
from multigpu.devices import format_size
from multigpu.log import logger as log
from multigpu.planning.footprint import SPELLING, Footprint
from multigpu.throttle import give_back_memory, memory_limit, private_memory, reset_peak_memory, resident_memory

__all__ = ["DeviceMemory", "KeptProcessMemory", "MemoryProbe", "OutOfMemoryStepError", "ProcessMemory",
           "is_out_of_memory"]

_MESSAGES = ("can't allocate memory", "out of memory", "cannot allocate memory", "oom when allocating",
             "resource_exhausted", "resource exhausted",
             "status: 1, message: could not execute a primitive",  # oneDNN's status 1: dnnl_out_of_memory
             "ynnpack operation failed")  # XLA's CPU kernels (JAX) when their workspace cannot be allocated
SHRINK = 0.9  # a device that ran out at N rows is planned at most 0.9 N (or the most it has held below N)


class OutOfMemoryStepError(Exception):
    """Raised on every rank after a sum in which a rank said it ran out of memory.

    Attributes:
        rows: for each rank, the rows it could not hold (0 where it held its rows).
        at: ``time.time()`` when the sum told it.
    """

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"ran out of memory: {rows}")
        self.rows = rows
        self.at = time.time()


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed allocation: Python's ``MemoryError``, or any backend's out-of-memory error
    (torch's ``OutOfMemoryError`` and CPU allocator, TensorFlow's ``ResourceExhaustedError``, XLA's
    ``RESOURCE_EXHAUSTED``), told by its message."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, Exception) and any(m in str(exc).lower() for m in _MESSAGES)


class MemoryProbe(Protocol):
    """What a backend measures of one device's memory."""

    def start(self) -> tuple[int, int] | None:
        """Before a measured step: the peak statistic reset; ``(bytes held now, bytes left)``, or None where
        nothing can be measured."""

    def peak(self) -> int:
        """After the step: the peak bytes held since :meth:`start` (on its scale)."""

    def release(self) -> None:
        """Gives back what the allocator keeps after a failed pass."""


class ProcessMemory:
    """A CPU device given a memory size: the process's memory under its ``RLIMIT_DATA`` (every backend)."""

    def start(self) -> tuple[int, int] | None:
        limit = memory_limit()
        if limit is None:
            return None
        reset_peak_memory()
        now, _, files = resident_memory()
        return now - files, limit - private_memory()  # the file-backed pages a step first touches are not its own

    def peak(self) -> int:
        _, peak, files = resident_memory()
        return peak - files

    def release(self) -> None:
        give_back_memory()


class KeptProcessMemory:
    """A CPU device given a memory size whose framework keeps what it allocated (TensorFlow's CPU allocator
    pools large tensors and never gives the pool back): the process's private memory, what the limit counts,
    measured from where the device's size began (a step's peak is what the pool has grown to after it).

    Args:
        size: the device's given memory, in bytes.
    """

    def __init__(self, size: int) -> None:
        self.size = size

    def start(self) -> tuple[int, int] | None:
        limit = memory_limit()
        return None if limit is None else (limit - self.size, self.size)

    def peak(self) -> int:
        return private_memory()

    def release(self) -> None:
        give_back_memory()


class DeviceMemory:
    """The memory of one parallel model's devices (see the module docstring).

    Args:
        comm: the run's collectives (rank, world size, devices).
        balancer: the owner of the shares and the caps.
        probe: what measures this rank's device (a GPU's probe; None: :class:`ProcessMemory`).
        kept: the framework's CPU allocator keeps what it allocated (:class:`KeptProcessMemory` on a CPU device).
    """

    def __init__(self, comm, balancer, probe: MemoryProbe | None = None, kept: bool = False) -> None:
        self.comm = comm
        self.balancer = balancer
        devices = comm.runtime.devices
        # Where a step may run out of memory and be taken again (GPUs, CPU devices given a size): the states a
        # forward pass changes are kept before each step.
        self.bounded = any(d.is_cuda or d.memory is not None for d in devices)
        mine = devices[comm.rank]
        self.measured_here = mine.memory is not None or (mine.is_cuda and probe is not None)
        if mine.is_cuda and probe is not None:
            self.probe: MemoryProbe = probe
        else:
            self.probe = KeptProcessMemory(mine.memory) if kept and mine.memory is not None else ProcessMemory()
        self.rows = RowMemory()
        self.largest: list[int] = [0] * comm.world_size  # the largest local batch each rank has held
        self._base: tuple[int, int] | None = None  # (bytes held before the step, bytes left) while measuring
        self.available: int | None = None  # bytes this device had left before its last measured step
        self._said: set[int] = set()  # the ranks whose measured cap the log has given

    # ------------------------------------------------------------ measured
    def begin(self, rows: int) -> None:
        """Before a step's forward pass: measures it when it is among the first at its size."""
        self._base = None
        if self.measured_here and self.rows.due(rows):
            self._base = self.probe.start()

    def end(self, rows: int) -> int:
        """After the backward pass: the cap this rank sends (0: nothing new)."""
        if self._base is None:
            return 0
        held, left = self._base
        self._base = None
        self.rows.add(rows, self.probe.peak() - held, left)
        self.available = left
        cap = self.rows.cap(left, rows)
        return 0 if cap is None else max(cap, 1)

    def describe(self) -> str:
        """``"8 KiB kept a row, 12 MiB + 96 KiB a row of 180 MiB left"`` (what the measurements found), or ``""``."""
        found = self.rows.model()
        if found is None or self.available is None:
            return ""
        fixed, per_row = found
        row = f"{format_size(int(per_row) // 1024 * 1024)} a row"
        left = format_size(int(self.available) // (1 << 20) * (1 << 20))
        kept = int(self.rows.kept_per_row() or 0) // 1024 * 1024
        kept_text = f"{format_size(kept)} kept a row, " if kept else ""
        return (f"{kept_text}{format_size(int(fixed) // 1024 * 1024)} + {row} of {left} left" if fixed else
                f"{kept_text}{row} of {left} left")

    # ------------------------------------------------------------ before the first step
    def left(self) -> int | None:
        """Bytes this rank's device has left now, on the scale its limit counts (None where it is not known: a
        CPU device given no size)."""
        mine = self.comm.runtime.devices[self.comm.rank]
        if not mine.is_cuda and mine.memory is not None:
            limit = memory_limit()
            return None if limit is None else limit - private_memory()
        found = self.probe.start() if self.measured_here else None
        return None if found is None else int(found[1])

    def check_state(self, footprint: Footprint, level: str, levels: Sequence[str]) -> None:
        """Before ``fit``'s first step (a collective: every rank): raises the same ``ValueError`` on every rank
        when a device cannot hold what the first step adds to the training state at ``level`` (gradients,
        optimizer state: :mod:`multigpu.planning.footprint`), naming each device's memory left and which of
        ``levels`` (those this run may take) would fit."""
        seen = self.comm.gather_objects(self.left(), "checking that the training state fits")

        def short(at: str) -> list[int]:
            return [r for r, left in enumerate(seen) if left is not None and footprint.adds(at, r) > left]

        if not short(level):
            return
        devices = self.comm.runtime.devices

        def mib(n: float) -> str:
            return f"{n / (1 << 20):.1f} MiB"

        def memory(r: int) -> str:
            d = devices[r]
            return f"{format_size(d.memory)} given" if d.memory is not None and not d.is_cuda else "a GPU"

        def parts(at: str, r: int) -> str:
            state = footprint.state if at == "whole" else footprint.owned[r]
            grads = "" if at in ("gradients", "weights") else f"gradients {mib(footprint.gradients)}, "
            if at == "weights":
                grads = (f"a layer's weights {mib(footprint.largest)} at least, less the others' part of the "
                         f"weights {mib(footprint.gradients - footprint.weights_owned[r])}, ")
            return f"{grads}optimizer state {mib(state)}"

        lines = [f"{devices[r].label} ({memory(r)}) has {mib(seen[r])} left after the weights, and the first step "
                 f"adds {mib(footprint.adds(level, r))} ({parts(level, r)})" for r in short(level)]
        fits = [at for at in levels if not short(at)]
        if fits:
            best = fits[0]
            advice = (f"{SPELLING[best]} fits: the first step adds " + ", ".join(
                f"{mib(footprint.adds(best, r))} on {devices[r].label}" for r in range(len(seen))
                if seen[r] is not None) + f"; give parallelize {SPELLING[best]}.")
        else:
            least = min(levels, key=lambda at: max(footprint.adds(at, r) - (seen[r] or 0) for r in short(at)))
            need = {r: footprint.adds(least, r) - seen[r] for r in short(least)}
            advice = (f"No level this run may take fits ({', '.join(SPELLING[at] for at in levels)}); the least, "
                      f"{SPELLING[least]}, needs " + ", ".join(f"{mib(n)} more on {devices[r].label}"
                                                               for r, n in need.items()) +
                      ". Give those devices more memory, or train a smaller model.")
        raise ValueError(f"the training state does not fit at {SPELLING[level]}: {'; '.join(lines)}. {advice}")

    # ------------------------------------------------------------ ran out
    def release(self) -> None:
        """After a failed pass (its holders let go by the backend): gives back what the allocator keeps."""
        self._base = None
        gc.collect()
        self.probe.release()

    def fitted(self, sizes) -> None:
        """A step ran at ``sizes`` rows per rank on every rank: each held its rows."""
        self.largest = [max(a, int(b)) for a, b in zip(self.largest, sizes)]

    def read(self, short: list[int], caps: list[int]) -> None:
        """Reads a step's summed memory sections (the same on every rank): new caps are planned with from the
        next batch, and said when a device's is first measured or changes the shares; a rank that ran out of
        memory raises :class:`OutOfMemoryStepError` (no rank applies the step)."""
        devices = self.comm.runtime.devices
        for r, cap in enumerate(caps):
            if cap <= 0:
                continue
            changed = self.balancer.measured_cap(r, cap)
            first = r not in self._said
            self._said.add(r)
            if (changed or first) and self.comm.rank == self.comm.leader:
                total = self.balancer.batch_size or 0
                shares = "/".join(f"{s / total:.0%}" for s in self.balancer.shares(total)) if total else ""
                how = self.describe() if r == self.comm.rank else ""
                log.info(f"{devices[r].label} holds at most {cap} rows"
                         f"{f' ({how})' if how else ''}: shares {shares} of {total}.")
        if any(short):
            raise OutOfMemoryStepError(list(short))

    def word(self, short: int = 0) -> np.ndarray:
        """The word a step of the model's own adds to its first gradient sum (one float per rank; ``short``, the
        rows this rank could not hold, at its own): a rank whose step ran out of memory before that sum joins it
        with zeros and its word, and every rank raises before its update (:meth:`read_word`), so that the driver
        takes the step again."""
        word = np.zeros(self.comm.world_size, np.float32)
        word[self.comm.rank] = short
        return word

    def ran_out(self, rows: int, first: int | None, variables, reduce, dtype=np.float32) -> None:
        """This rank's step of the model's own ran out of memory before its first gradient sum: what it held is
        given back and it joins that sum (``first`` values long; unknown before a first step: the ``variables``'
        size) with zeros and its word, through ``reduce``; raises :class:`OutOfMemoryStepError` on every rank."""
        self.release()
        n = first if first is not None else sum(int(np.prod(v.shape)) for v in variables)
        summed = reduce(np.concatenate([np.zeros(n, dtype), self.word(rows).astype(dtype)]))
        self.read_word(np.asarray(summed)[n:])

    def read_word(self, summed) -> None:
        """Reads the summed word of a step of the model's own: raises :class:`OutOfMemoryStepError` on every rank
        where one ran out."""
        self.read([round(float(v)) for v in summed], [0] * self.comm.world_size)

    def cut_again(self, short: OutOfMemoryStepError, plan):
        """Lowers the caps of the ranks that ran out and cuts the same global batch again by them: ``(this
        rank's rows, new plan)``; ends the run when the ratios are fixed, or the devices cannot hold the global
        batch together."""
        began = time.perf_counter()
        devices = self.comm.runtime.devices
        members = [r for r in range(self.comm.world_size) if r not in self.balancer.lost]
        for r, rows in enumerate(short.rows):
            if rows:
                held = self.largest[r] if self.largest[r] < rows else 0
                fits = max(held, int(rows * SHRINK)) if rows > 1 else 0
                if not self.balancer.options.auto:
                    self._fixed_ratios_do_not_fit(r, rows, fits, plan)
                self.balancer.lower_cap(r, fits)
        caps = self.balancer.options.caps
        room = sum(plan.total if caps[r] is None else caps[r] for r in members)
        if room < plan.total or all(caps[r] == 0 for r in members):
            detail = ", ".join(f"{devices[r].label} at most {caps[r]} rows" if caps[r] is not None else
                               f"{devices[r].label} no cap" for r in members)
            failure.fail(f"the devices cannot hold a global batch of {plan.total} rows together ({detail}): the "
                         f"largest global batch that fits is {room} rows. Give fit a batch_size of at most {room}.")
        again = self.balancer.planner.again(True)
        if again is None:
            failure.fail("a device ran out of memory and this batch cannot be cut again (its input was read once): "
                         "give parallelize max_batch= caps, or feed arrays, tensors, a PyDataset or a generator.")
        new_plan, data = again
        if self.comm.rank == self.comm.leader:
            ran_out = ", ".join(f"{devices[r].label} at {rows} rows" for r, rows in enumerate(short.rows) if rows)
            capped = ", ".join(f"{devices[r].label} holds at most {caps[r]} rows"
                               for r, rows in enumerate(short.rows) if rows)
            shares = ", ".join(f"{devices[r].label} {new_plan.sizes[r]}" for r in members)
            log.info(f"out of memory on {ran_out}: {capped}; the step again with rows {shares} of "
                     f"{new_plan.total} ({time.time() - short.at + (time.perf_counter() - began):.2f} s after the "
                     "error).")
        return data, new_plan

    def _fixed_ratios_do_not_fit(self, rank: int, rows: int, fits: int, plan) -> None:
        device = self.comm.runtime.devices[rank]
        memory = (f"{format_size(device.memory)} given" if device.memory is not None else
                  "a GPU" if device.is_cuda else "the machine's memory")
        ratios = self.balancer.ratios
        share = fits / plan.total
        others = sum(ratios) - ratios[rank]
        largest = share / (1 - share) * others if share < 1 else float("inf")
        failure.fail(
            f"{device.label} ({memory}) ran out of memory with {rows} rows of a global batch of {plan.total}, "
            f"its part of the fixed ratios {':'.join(f'{r:g}' for r in ratios)}; it holds about {fits} rows, "
            f"{share:.0%} of the batch: give it a ratio of at most {largest:.2g} (the others as they are), "
            "a smaller batch_size, or ratios='auto' (shares that fit every device's memory).")
