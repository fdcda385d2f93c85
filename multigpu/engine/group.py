"""The run's process group on torch.distributed: rendezvous, joining, leaving (the torch and TensorFlow backends).

CPU devices use gloo, CUDA devices NCCL.  On one machine the supervisor hosts
the ``TCPStore`` on 127.0.0.1 and a free port (the listening socket is handed
to the store, so no other process can take the port between choosing and
binding it); under an outside launcher (torchrun, ``srun``, ``mpirun``) the
group meets at the rendezvous that launcher gave (torchrun's own store where
it runs one).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from multigpu import env, failure

__all__ = ["join", "leave", "process_group_backend"]


def process_group_backend(runtime) -> str:
    """``nccl`` when every device is a GPU, else ``gloo``."""
    return "nccl" if all(d.is_cuda for d in runtime.devices) else "gloo"


def _store(runtime, fd: str | None):
    """The run's TCPStore; rank 0 serves it on the supervisor's socket ``fd``."""
    where = runtime.environment
    args = (where.master_addr, where.master_port, runtime.world_size, fd is not None,
            datetime.timedelta(seconds=runtime.timeout))
    extra = {"master_listen_fd": int(fd)} if fd is not None else {}
    if fd is not None and tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 5):
        extra["use_libuv"] = False  # torch < 2.5: its libuv store cannot serve a socket it did not open
    return dist.TCPStore(*args, wait_for_workers=False, **extra)


_FORK_GUARDED = False


def _settle_before_fork() -> None:
    """Waits, holding the GIL, until no thread holds CPython's thread-state lock, just before this process forks.

    A gloo thread that finishes a collective drops its tensors, which takes
    the GIL through a new thread state, made under that lock without the
    GIL.  CPython before 3.12 (gh-112275) takes the lock again in the child
    before resetting it, so a fork (a ``DataLoader``'s workers) at that
    instant leaves a child that never starts, and a loader that waits for
    it forever.  ``sys._current_frames`` takes and releases the lock.
    """
    sys._current_frames()


def _guard_forks() -> None:
    global _FORK_GUARDED
    if not _FORK_GUARDED and sys.version_info < (3, 12):
        os.register_at_fork(before=_settle_before_fork)
        _FORK_GUARDED = True


def join(runtime, process_group: str | None = None) -> None:
    """Joins the run's process group (and, under an outside launcher, learns every rank's device).

    Args:
        runtime: the run.
        process_group: ``"gloo"`` or ``"nccl"``; by default NCCL when every device is a GPU, else gloo (the
            TensorFlow backend, which sums on the host, asks for gloo).
    """
    _guard_forks()
    if env.get(env.REJOIN) == "1":
        return  # a lost rank started again: it joins a group of the others at a step of fit (Comm.rejoin)
    backend = process_group or process_group_backend(runtime)
    kwargs = {"backend": backend, "rank": runtime.rank, "world_size": runtime.world_size,
              "timeout": datetime.timedelta(seconds=runtime.timeout)}
    where = runtime.environment
    if where.knows_every_device:  # multigpu's supervisor: rank 0 serves the store on the socket it opened
        kwargs["store"] = _store(runtime, env.pop(env.STORE_FD))
    else:  # torch's TCP rendezvous (a client of torchrun's agent store where torchrun runs one)
        kwargs["init_method"] = f"tcp://{_host(where.master_addr)}:{where.master_port}"
    if runtime.device.is_cuda and backend == "nccl":
        kwargs["device_id"] = torch.device(f"cuda:{runtime.device.index}")
    try:
        dist.init_process_group(**kwargs)
    except Exception as exc:  # a peer that never came, a store that went away
        failure.fail(f"could not join the run's process group: {type(exc).__name__}: {exc}")
    if not where.knows_every_device:
        from multigpu.devices import parse_devices

        specs: list[str | None] = [None] * runtime.world_size
        dist.all_gather_object(specs, runtime.device.spec)
        mine = runtime.device
        runtime.devices = [mine if r == runtime.rank else parse_devices([s], num_gpus=10**6)[0]
                           for r, s in enumerate(specs)]


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def leave(failed: bool) -> None:
    """Leaves the group at exit: together with the others after a success, at once after a failure.

    After a success a barrier comes first, so that no rank closes its
    connections while a peer still uses them (gloo aborts the peer
    otherwise).  After a failure the group is not touched again: a
    collective with a vanished peer could wait for the whole timeout.
    """
    if failed or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass
