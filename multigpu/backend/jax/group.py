"""The run's processes on JAX: ``jax.distributed`` (XLA's CPU collectives over gloo).

JAX lets a process join a multi-process run only before its first JAX
computation, and a user's script builds its model before it calls
``parallelize``.  So the ranks join as soon as they start, before the script
runs (:mod:`multigpu.runtime.rank_entry` calls :func:`multigpu.runtime.start`
first when ``KERAS_BACKEND=jax``); ``join`` at ``parallelize`` time then finds
the run already joined.  On several machines, torchrun starts each rank
through the same entry: ``torchrun ... -m multigpu.runtime.rank_entry script
train.py ARGS``.

Rank 0 hosts JAX's coordinator on the port the supervisor chose: it closes the
listening socket the supervisor opened for it just before (no process can
take the port while the supervisor holds it).

A rank ends on ``SIGTERM``, as on the other backends: the supervisor stops
the ranks with it after a failure, and Linux sends it to each rank when the
supervisor dies (a ``multigpu run`` or a notebook kernel killed with
``SIGKILL``).  JAX's preemption service, which ``jax.distributed.initialize``
starts by default, takes ``SIGTERM`` as a notice of preemption and lets the
process run on (its ranks trained on for over a minute after their
supervisor was killed), so the ranks join with it off; multigpu has no use
for its sync points.
"""

from __future__ import annotations

import os

from multigpu import env, failure

__all__ = ["bind", "check_platform", "coordination_client", "join", "leave"]

_JOINED = False


def bind(device) -> None:
    """Makes this process's JAX use its device alone: its GPU (``jax_cuda_visible_devices``) or the CPU.

    It takes effect only before the process's first JAX computation: the ranks
    multigpu starts bind as soon as they start.  XLA's CPU threads follow the
    process's cores (set by the runtime).
    """
    import jax

    if _backends_initialized():
        return  # a single-device run whose script computed already: JAX's own default device
    if device.is_cuda:
        jax.config.update("jax_cuda_visible_devices", str(device.index))
    else:
        jax.config.update("jax_platforms", "cpu")


def check_platform(device, platform: str, version: str) -> None:
    """Raises when JAX's device is not of the kind the run gave this process.

    Raises:
        RuntimeError: naming the device, what JAX found and its version.
    """
    if device.is_cuda and platform != "gpu":
        raise RuntimeError(
            f"device {device.spec!r} is a GPU, but jax {version} found no GPU for it (platform {platform!r}): "
            "install JAX's CUDA build (pip install 'jax[cuda12]' or 'jax[cuda13]'), or use CPU devices.")


def _jax_version() -> str:
    import jax

    return jax.__version__


def join(runtime) -> None:
    """Joins the run through ``jax.distributed.initialize`` (once per process)."""
    global _JOINED
    if _JOINED:
        return
    import jax

    if _backends_initialized():
        how = ("`multigpu run train.py ...` under it (or `torchrun ... -m multigpu.runtime.rank_entry script "
               "train.py ...`)" if not runtime.environment.knows_every_device
               else "`python train.py` (parallelize starts the devices) or `multigpu run --devices ... train.py`")
        raise RuntimeError(
            "multigpu on JAX joins a run before the program's first JAX computation, which only a rank that "
            f"multigpu starts can do: run it as {how}. Received: a process that computed with JAX before joining"
        )
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as exc:  # an old JAX without XLA's CPU collectives
        raise RuntimeError(f"multigpu on JAX needs XLA's gloo CPU collectives (jax >= 0.5). Received: jax "
                           f"{_jax_version()} ({type(exc).__name__}: {exc})") from exc
    try:
        jax.config.update("jax_enable_preemption_service", False)  # SIGTERM ends the rank (the module's docstring)
    except AttributeError:  # a JAX without the service: SIGTERM ends the rank already
        pass
    fd = env.pop(env.STORE_FD)
    if fd is not None:  # the supervisor's listening socket: free the port for JAX's coordinator
        os.close(int(fd))
    address = runtime.environment.coordinator
    try:
        jax.distributed.initialize(address, num_processes=runtime.world_size, process_id=runtime.rank,
                                   initialization_timeout=max(1, int(runtime.timeout)))
    except Exception as exc:
        failure.fail(f"could not join the run through jax.distributed at {address}: {type(exc).__name__}: "
             f"{str(exc).splitlines()[0] if str(exc) else ''}")
    _JOINED = True
    try:
        check_platform(runtime.device, jax.local_devices()[0].platform, _jax_version())
    except RuntimeError as exc:
        failure.fail(str(exc))
    if not runtime.environment.knows_every_device:
        _learn_devices(runtime)


def _backends_initialized() -> bool:
    """True once this process has computed with JAX (a JAX internal; a JAX without it lets
    ``jax.distributed.initialize`` raise instead)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def _learn_devices(runtime) -> None:
    """Under an outside launcher each machine knows its own devices only: every rank's spec, gathered."""
    import numpy as np
    from jax.experimental import multihost_utils

    from multigpu.devices import parse_devices

    mine = np.zeros(64, dtype=np.uint8)
    raw = runtime.device.spec.encode()[:64]
    mine[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    specs = [bytes(row).rstrip(b"\0").decode() for row in np.asarray(multihost_utils.process_allgather(mine))]
    runtime.devices = [runtime.device if r == runtime.rank else parse_devices([s], num_gpus=10**6)[0]
                       for r, s in enumerate(specs)]


def coordination_client():
    """The client of ``jax.distributed``'s coordination service (its key-value store), once joined.

    JAX has no public name for it: reached here only (``jax._src.distributed.global_state.client``).

    Raises:
        RuntimeError: when this process has not joined a run, or this JAX has no such client.
    """
    try:
        from jax._src.distributed import global_state
    except ImportError as exc:
        raise RuntimeError(f"multigpu on JAX needs jax.distributed's coordination service (its key-value store and "
                           f"barriers), which jax {_jax_version()} does not have where expected ({exc}).") from exc
    client = getattr(global_state, "client", None)
    missing = [m for m in ("key_value_set_bytes", "blocking_key_value_get_bytes", "key_value_delete",
                           "wait_at_barrier") if not hasattr(client, m)]
    if client is None or missing:
        raise RuntimeError("multigpu on JAX needs jax.distributed's coordination service (its key-value store and "
                           "barriers): "
                           f"{'this process has not joined a run' if client is None else 'missing ' + str(missing)} "
                           f"(jax {_jax_version()}).")
    return client


def leave(failed: bool) -> None:
    """Leaves the run at exit: with the others after a success, at once after a failure."""
    if failed or not _JOINED:
        return
    try:
        import jax

        jax.distributed.shutdown()
    except Exception:
        pass
