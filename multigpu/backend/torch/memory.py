"""A device that runs out of memory in a training step, on torch: every rank leaves the step, the step is cut
again within what fits, and taken again, exactly as one device would take it.

A rank whose forward or backward pass fails to allocate (``torch.OutOfMemoryError`` on a GPU, the CPU
allocator's ``can't allocate memory`` on a CPU device given a memory size, a ``MemoryError``) frees what the
pass held and goes on to the step's one sum with no gradients, saying in the sum's last word how many rows
it could not hold.  Every rank reads the same sum, so every rank sees it at once, before any weight changed:
none applies the step (no rank hangs, as the others of a DDP run do).  The balancer lowers that device's
cap (:meth:`~multigpu.balancing.balancer.LoadBalancer.lower_cap`) and the same global batch is planned and
cut again.  Only a global batch the devices cannot hold together ends the run, naming each device's cap.
"""

from __future__ import annotations

import gc
import time

import torch

from multigpu import failure
from multigpu.throttle import give_back_memory

__all__ = ["DeviceMemory", "OutOfMemoryStepError"]


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


_MESSAGES = ("can't allocate memory", "out of memory", "cannot allocate memory")


class DeviceMemory:
    """Out-of-memory steps of one parallel model on torch.

    Args:
        comm: the run's collectives (rank, world size, devices).
        balancer: the owner of the shares and the caps.
    """

    def __init__(self, comm, balancer) -> None:
        self.comm = comm
        self.balancer = balancer
        devices = comm.runtime.devices
        # Where a step may run out of memory and be taken again (GPUs, CPU devices given a size): the states a
        # forward pass changes are kept before each step.
        self.bounded = any(d.is_cuda or d.memory is not None for d in devices)
        self.largest: list[int] = [0] * comm.world_size  # the largest local batch each rank has held

    @staticmethod
    def is_out_of_memory(exc: BaseException) -> bool:
        """Whether ``exc`` is a failed allocation (torch's out-of-memory error, the CPU allocator's, Python's)."""
        if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
            return True
        return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _MESSAGES)

    def release(self) -> None:
        """Gives back what the failed pass held."""
        gc.collect()
        if self.comm.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            give_back_memory()

    def fitted(self, sizes) -> None:
        """A step ran at ``sizes`` rows per rank on every rank: each held its rows."""
        self.largest = [max(a, int(b)) for a, b in zip(self.largest, sizes)]

    def check(self, slots: list[float]) -> None:
        """Raises :class:`OutOfMemoryStepError` when a rank said (in the sum's last slots) it ran out of memory."""
        rows = [round(v) for v in slots]
        if any(rows):
            raise OutOfMemoryStepError(rows)

    def cut_again(self, short: OutOfMemoryStepError, plan):
        """Lowers the caps of the ranks that ran out and cuts the same global batch again by them: ``(this
        rank's rows, new plan)``; ends the run when the devices cannot hold the global batch together."""
        began = time.perf_counter()
        devices = self.comm.runtime.devices
        for r, rows in enumerate(short.rows):
            if rows:
                held = self.largest[r] if self.largest[r] < rows else 0
                self.balancer.lower_cap(r, max(held, int(rows * 0.8)) if rows > 1 else 0)
        caps = self.balancer.options.caps
        members = [r for r in range(self.comm.world_size) if r not in self.balancer.lost]
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
            print(f"multigpu: out of memory on {ran_out}: {capped}; the step again with rows {shares} of "
                  f"{new_plan.total} ({time.time() - short.at + (time.perf_counter() - began):.2f} s after the "
                  "error).", flush=True)
        return data, new_plan
