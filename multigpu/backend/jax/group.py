"""The run's processes on JAX: ``jax.distributed`` (XLA's CPU collectives over gloo).

JAX lets a process join a multi-process run only before its first JAX
computation, and a user's script builds its model before it calls
``parallelize``.  So the ranks multigpu starts join as soon as they start,
before the script runs (:mod:`multigpu.runtime.rank_entry` calls
:func:`multigpu.runtime.start` first when ``KERAS_BACKEND=jax``); ``join`` at
``parallelize`` time then finds the run already joined.

Rank 0 hosts JAX's coordinator on the port the supervisor chose: it closes the
listening socket the supervisor opened for it just before (no process can
take the port while the supervisor holds it).
"""

from __future__ import annotations

import os

from multigpu import env

__all__ = ["bind", "join", "leave"]

_JOINED = False


def bind(device) -> None:
    """Nothing to set on JAX: XLA's CPU threads follow the process's cores (set by the runtime)."""
    if device.is_cuda:
        raise RuntimeError(
            "multigpu on JAX runs on CPU devices for now; GPUs need the torch backend (KERAS_BACKEND=torch). "
            f"Received: device {device.spec!r}"
        )


def _jax_version() -> str:
    import jax

    return jax.__version__


def join(runtime) -> None:
    """Joins the run through ``jax.distributed.initialize`` (once per process)."""
    global _JOINED
    if _JOINED:
        return
    import jax
    from jax._src import xla_bridge

    from multigpu.runtime import fail

    if runtime.mode == "torchrun" or xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "multigpu on JAX joins a run before the program's first JAX computation, which only the processes "
            "multigpu starts can do: run the script with `python train.py` (parallelize starts the devices) or "
            "`multigpu run --devices ... train.py`. Received: a process that "
            + ("torchrun started" if runtime.mode == "torchrun" else "computed with JAX before joining")
        )
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as exc:  # an old JAX without XLA's CPU collectives
        raise RuntimeError(f"multigpu on JAX needs XLA's gloo CPU collectives (jax >= 0.4.30). Received: jax "
                           f"{_jax_version()} ({type(exc).__name__}: {exc})") from exc
    fd = os.environ.pop(env.STORE_FD, None)
    if fd is not None:  # the supervisor's listening socket: free the port for JAX's coordinator
        os.close(int(fd))
    address = f"{os.environ.get(env.MASTER_ADDR, '127.0.0.1')}:{os.environ[env.MASTER_PORT]}"
    try:
        jax.distributed.initialize(address, num_processes=runtime.world_size, process_id=runtime.rank,
                                   initialization_timeout=max(1, int(runtime.timeout)))
    except Exception as exc:
        fail(f"could not join the run through jax.distributed at {address}: {type(exc).__name__}: "
             f"{str(exc).splitlines()[0] if str(exc) else ''}")
    _JOINED = True


def leave(failed: bool) -> None:
    """Leaves the run at exit: with the others after a success, at once after a failure."""
    if failed or not _JOINED:
        return
    try:
        import jax

        jax.distributed.shutdown()
    except Exception:
        pass
