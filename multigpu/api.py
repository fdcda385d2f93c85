"""The public entry points: ``parallelize``, ``multi_gpu_model``, ``state``, ``list_devices``, ``rank``,
``world_size``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from multigpu import arguments, backend, env
from multigpu.devices import Device, usable_cores
from multigpu.log import logger as log
from multigpu.planning.shares import parse_ratios, validate_ratios
from multigpu.runtime import runtime as _runtime

if TYPE_CHECKING:  # Keras is imported when a model is parallelized, not when multigpu is
    import keras

    from multigpu.keras.parallel import State

__all__ = ["list_devices", "multi_gpu_model", "parallelize", "rank", "state", "unparallelize", "world_size"]

DeviceSpec = str | int | Device
_COMMS: dict = {}


def parallelize(
    model: keras.Model,
    devices: str | DeviceSpec | Sequence[DeviceSpec] | None = None,
    ratios: str | os.PathLike | Sequence[float] | None = None,
    *,
    timeout: float | None = None,
    sync_batchnorm: bool = False,
    rebalance: bool | None = None,
    profile: str | os.PathLike | None = None,
    recalibrate: bool = False,
    max_batch: Sequence[int | None] | None = None,
    report: bool = False,
    compression: str | None = None,
    transport: str | None = None,
    overlap: bool | None = None,
    bucket_mb: float | None = None,
    replay: bool | None = None,
    min_devices: int | None = None,
    shard_optimizer: bool | None = None,
    shard: str | None = None,
) -> keras.Model:
    """Trains ``model`` data-parallel across ``devices``, one process each.

    Call it once, after building the model and before ``compile``/``fit``.  In
    a plain ``python train.py`` with several devices, the first call turns
    this process into the run's supervisor: it runs the script again once per
    device and exits with the run's exit code, so the code after
    ``parallelize`` runs in the ranks.  Under ``multigpu run`` or an outside
    launcher (torchrun, ``srun``, ``mpirun``, Kubernetes' torch variables) it
    joins the running group.  With one device it changes nothing.

    One rule for settings given in more than one place: what ``multigpu
    run``'s command line or ``multigpu.launch`` is given for the run
    (``--devices``, ``--ratios``, ``--timeout``, ``--min-devices``) wins over
    an argument given here, which wins over the ``MULTIGPU_*`` variable that
    stands in for it (``MULTIGPU_TRANSPORT``...); where two given ones
    differ, rank 0 says in one line which it took.

    ``fit``'s ``batch_size`` is the global batch.  It is split across the
    devices in proportion to the shares, and gradients are combined weighted
    by each device's share, so the result equals one device training on the
    whole batch.

    Args:
        model: a Keras 3 model (torch, JAX or TensorFlow backend).
        devices: ``None`` or ``"auto"`` (the default: every GPU; on a machine
            without one, a CPU device per core, at most 8), or a list such as ``[0, 1]``,
            ``["cuda:0", "cuda:1"]`` or ``["cpu:0", "cpu:1@0.5"]``.
        ratios: relative speed of each device, e.g. ``[3, 1]`` or ``"3,1"``;
            ``"auto"`` to measure the speeds (or take them from the profile)
            and keep the shares at the fastest measured; the path of a
            profile file to reuse its ratios.  ``None`` (default) means
            ``"auto"`` when the devices differ and equal shares otherwise.
        timeout: seconds a collective may wait for another rank before the
            run fails (default 60).
        min_devices: go on without a device that is lost (its process
            killed, crashed, or silent for 5 s) while at least this many are
            left: the others take its rows, from the step it was lost in,
            and the result stays exact; under ``multigpu run --max-restarts
            K`` its process is started again and rejoins at a step of
            ``fit``.  ``None`` (default): a lost device ends the run.  On
            torch and TensorFlow under ``python train.py``, ``multigpu run``
            and ``multigpu.launch``, for arrays and tensors
            (``MULTIGPU_MIN_DEVICES`` when unset); JAX keeps restart and
            resume (its sums run inside XLA and cannot leave a broken group).
        sync_batchnorm: compute BatchNormalization's batch statistics over
            the whole global batch, so a BatchNorm model reproduces the
            single-device run; by default each device normalises over its
            own share and the moving statistics are averaged over devices.
        rebalance: move shares while training, keeping a move only when the
            measured samples/s rise (default: on with automatic ratios).
        profile: where measured shares are kept (default
            ``$MULTIGPU_PROFILE`` or ``~/.cache/multigpu/profiles.json``).
        recalibrate: measure again even if the profile has an entry.
        max_batch: the largest local batch each device can hold (``None``
            for no limit); the excess goes to devices with room.
        report: print, at the end of each epoch, where each device's time
            went (waiting for input, Keras's loop, computing, waiting for
            the other devices).
        compression: ``None`` (exact, default), ``"bf16"`` or ``"fp16"``:
            send gradients in 16 bits (half the bytes; the weighting by share
            stays exact, the sum is rounded).
        transport: how CPU ranks of one machine sum gradients: ``"auto"``
            (default: shared memory on x86-64 Linux, else the process
            group's), ``"shm"`` or ``"gloo"``.
        overlap: on torch, sum gradients in buckets during the backward pass
            (``True``) or after it (``False``); default: during it between
            machines and on GPUs, after it for CPU ranks of one machine.
        bucket_mb: on torch, the size of those buckets in MiB (default 4; the
            first bucket is 1 MiB).
        replay: on torch, ``False`` runs Keras's own forward pass at every
            step instead of replaying its recorded operations (the same
            numbers either way: for measuring what the replay buys).
        shard_optimizer: each device holds the optimizer state (Adam's
            moments, momenta) of a part of the weights and alone updates
            them (ZeRO stage 1): parts follow each device's memory
            (``cpu:0/2GiB``, a GPU's own on torch), equal where it is
            unknown.  The weights stay the same on every device after every
            step; saving writes the whole state, as one device would.  On
            JAX an optimizer with an EMA is refused.  Not with
            ``min_devices`` (a lost device's part would be lost).  Default
            (``None``): on where it was measured faster and smaller, the
            ranks of one machine summing through shared memory (torch and
            TensorFlow CPU devices: 0.98x to 1.15x the samples/s and 280 to
            727 MB less on a model whose Adam moments are 235 MB, in the
            memory guide), and not where the optimizer keeps no state per
            weight (SGD without momentum: decided when ``fit`` starts);
            off with ``min_devices``, between machines, on GPUs and on JAX,
            where the new weights' collective doubles the bytes on a link.
        shard: how much of the training state each device holds in parts:
            ``"optimizer"`` (``shard_optimizer=True``), or ``"gradients"``
            (torch): the optimizer state in parts, and the built-in step's
            gradients written into the sum's buffer while the backward pass
            makes them instead of kept beside it (one copy of the gradients
            less on every device; each device's update reads its own part of
            the sum; the sums no longer start during the backward pass, as
            they do by default between machines and on GPUs). Not with
            ``compression``, ``sync_batchnorm`` or ``overlap=True``.
            ``"weights"`` (torch; ZeRO stage 3): the gradients' level, and
            while ``fit`` runs each device holds only the trainable weights
            it owns; a layer's weights are gathered for its ``call`` and
            again before its backward pass, and let go after (no forward
            pass replay; the first step's calibration runs on the whole
            weights). They stay in parts after ``fit``: ``save``,
            ``save_weights``, ``get_weights``, ``set_weights`` and
            ``load_weights`` gather them for the call, so every rank makes
            it, as every call of the model.  Default (``None``):
            ``shard_optimizer``'s.

    Returns:
        The same model object, now parallel.

    Example:
        ```python
        model = multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], ratios=[3, 1])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=256, epochs=3)
        ```
    """
    facts = backend.facts()  # raises for a backend multigpu does not run on
    from multigpu._keras import compat as _compat

    _compat.check()
    arguments.check_model(model)
    arguments.check_flag("sync_batchnorm", sync_batchnorm)
    arguments.check_flag("rebalance", rebalance, allow_none=True)
    arguments.check_flag("recalibrate", recalibrate)
    arguments.check_flag("report", report)
    level = arguments.shard_level(shard, shard_optimizer, facts)
    arguments.check_sharding(level, min_devices, facts)
    if compression is not None and compression not in facts.compression:
        allowed = ", ".join(["None", *map(repr, facts.compression)])
        raise ValueError(f"`compression` must be one of {allowed} on the {facts.name} backend. "
                         f"Received: compression={compression!r}")
    say = _log_on_rank0(_runtime.rank())
    transport = env.fallback("transport", transport, env.TRANSPORT, say=say) or "auto"
    arguments.check_flag("overlap", overlap, allow_none=True)
    arguments.check_flag("replay", replay, allow_none=True)
    overlap = env.fallback("overlap", overlap, env.OVERLAP, arguments.switch(env.OVERLAP), say=say)
    arguments.check_streaming(level, compression=compression, sync_batchnorm=sync_batchnorm, overlap=overlap)
    if level in ("gradients", "weights") and overlap is None:
        overlap = False  # asked for: the gradients go into the sum during the backward pass, not in buckets
    replay = env.fallback("replay", replay, env.REPLAY, arguments.switch(env.REPLAY), say=say)
    bucket_mb = arguments.bucket_mb(env.fallback("bucket_mb", bucket_mb, env.BUCKET_MB, arguments.megabytes, say=say))
    if transport not in arguments.TRANSPORTS:
        raise ValueError(f"`transport` must be one of {', '.join(map(repr, arguments.TRANSPORTS))}. "
                         f"Received: transport={transport!r}")
    given = env.fallback("ratios", ratios, env.RATIOS, arguments.ratios_text, say=say,
                         same=lambda mine, theirs: arguments.as_given(mine) == theirs)
    spec = parse_ratios(given)
    planned = _runtime.planned_devices(devices)  # checks that need the device count, before any process starts
    if planned is not None:
        if spec.kind == "fixed":
            validate_ratios(given if not isinstance(given, str) else spec.values, len(planned))
        arguments.check_caps(max_batch, len(planned))
    runtime = _runtime.start(devices, timeout, say=say)
    n = runtime.world_size
    if spec.kind == "fixed":
        validate_ratios(spec.values or (), n)
    caps = arguments.check_caps(max_batch, n)
    auto = spec.kind == "auto"
    if spec.kind == "profile":
        spec, auto = arguments.ratios_from_profile(spec, n)
    elif spec.kind == "default":
        auto = arguments.devices_differ(runtime.devices, facts)
    min_devices = arguments.min_devices(env.fallback("min_devices", min_devices, env.MIN_DEVICES, int, say=say), n)
    arguments.check_sharding(level, min_devices if min_devices is not None and min_devices < n else None, facts)
    from multigpu.keras import parallel

    if n == 1:
        parallel.register_single(model, runtime)
        return model
    from multigpu.balancing.balancer import BalanceOptions, LoadBalancer

    options = BalanceOptions(spec, auto=auto, rebalance=auto if rebalance is None else rebalance,
                             profile=None if profile is None else os.fspath(profile), recalibrate=recalibrate,
                             caps=caps, report=report, grid=facts.grid, scan=facts.scan,
                             off_grid=facts.off_grid, compression=compression)
    comm = _COMMS.get(id(runtime))
    if comm is None:
        comm = _COMMS[id(runtime)] = backend.get().Comm(runtime, transport)
    shrinks = min_devices is not None and min_devices < n
    if shrinks:
        _allow_shrink(runtime, comm, min_devices, facts, say)
    by_default = level is None
    if by_default:
        level = arguments.shard_by_default(comm.transport, shrinks, facts,
                                           streams=compression is None and not sync_batchnorm and not overlap)
    balancer = LoadBalancer(runtime.devices, runtime.rank, options, _log_on_leader(comm))
    parallel.ParallelModel(model, runtime, comm, balancer,
                           parallel.Options(sync_batchnorm=sync_batchnorm, compression=compression,
                                            overlap=overlap, bucket_mb=bucket_mb, replay=replay,
                                            shard_optimizer=bool(level),
                                            shard_gradients=level in ("gradients", "weights"),
                                            shard_weights=level == "weights",
                                            shard_by_default=by_default and level == "optimizer"),
                           backend.get().Steps).install()
    return model


def _allow_shrink(runtime, comm, min_devices: int, facts, say) -> None:
    """Lets the run go on without a lost device, where the backend and the launcher can (else says why not)."""
    from multigpu import membership

    supervised = runtime.environment is not None and runtime.environment.knows_every_device
    if not facts.elastic or not supervised or not env.get(env.RUN_DIR):
        where = (f"the {facts.name} backend" if not facts.elastic
                 else f"{runtime.environment.name if runtime.environment else 'this launcher'}")
        say(f"min_devices={min_devices}: on {where} a lost device ends the run (restart it with "
            "BackupAndRestore); going on without one needs torch or TensorFlow under multigpu's own supervisor")
        return
    if all(d.is_cuda for d in runtime.devices) and not facts.sums_on_host:
        say(f"min_devices={min_devices}: on GPUs alone (an NCCL group) a lost device ends the run (restart it with "
            "BackupAndRestore): a sum that a lost GPU leaves unfinished waits on the others' GPUs, where leaving "
            "it needs NCCL's abort, which multigpu does not call; going on without a lost device needs a gloo "
            "group (CPU devices, or GPUs beside a CPU device)")
        return
    comm.min_devices = min_devices
    membership.allow_shrink(runtime.rank, min_devices)
    membership.start_heartbeat(runtime.rank)


def _log_on_leader(comm):
    def say(message: str) -> None:
        if comm.rank == comm.leader:
            log.info(message)
    return say


def _log_on_rank0(rank_: int):
    def say(message: str) -> None:
        if rank_ == 0:
            log.info(message)
    return say


def multi_gpu_model(model: keras.Model, gpus: int | Sequence[DeviceSpec] | str | None = None,
                    ratios: str | Sequence[float] | None = None, **kwargs) -> keras.Model:
    """Drop-in replacement for the old ``keras.utils.multi_gpu_model``.

    Args:
        model: the template model.
        gpus: a number of GPUs (the first ``gpus``), a list of GPU indices or
            any device spellings ``parallelize`` takes, or ``"auto"``. On a
            machine without GPUs, a number ``N`` gives ``N`` CPU devices (and
            says so).
        ratios: relative batch share per GPU, as in the community patch
            (e.g. ``[768, 560]``), or ``"auto"``; ``None`` as in ``parallelize``.
        **kwargs: the old ``cpu_merge``/``cpu_relocation`` are accepted and
            ignored (there is no merge: every device holds a full replica).

    Returns:
        The same model, parallel.  Save it directly: it is the template model.
    """
    unknown = set(kwargs) - {"cpu_merge", "cpu_relocation"}
    if unknown:
        raise TypeError(f"multi_gpu_model() got unexpected arguments: {sorted(unknown)}; it takes model, gpus, "
                        "ratios (and ignores cpu_merge, cpu_relocation)")
    if gpus is None:
        devices: object = "auto"
    elif isinstance(gpus, int) and not isinstance(gpus, bool):
        if gpus < 1:
            raise ValueError(f"`gpus` must be at least 1. Received: gpus={gpus}")
        kind = "cuda" if backend.gpu_count() else "cpu"
        devices = [f"{kind}:{i}" for i in range(gpus)]
        if kind == "cpu" and _runtime.rank() == 0 and env.get(env.RANK) is None:
            from multigpu._warn import warn_user

            warn_user(f"multi_gpu_model(gpus={gpus}): this machine has no GPU, so it trains on {gpus} CPU devices "
                      f"({', '.join(devices)}) instead.")
    elif isinstance(gpus, str):
        devices = gpus
    else:
        devices = list(gpus)
    return parallelize(model, devices=devices, ratios=ratios)


def state(model: keras.Model) -> State:
    """The run of a parallelized model, as it is now.

    Args:
        model: a model returned by :func:`parallelize`.

    Returns:
        A ``State`` with ``rank``, ``world_size``, ``devices``, ``ratios``
        (current shares), ``speeds``, ``last_report``, ``transport`` and
        ``shares(batch_size)``.
    """
    from multigpu.keras.parallel import state as _state

    return _state(model)


def unparallelize(model: keras.Model) -> keras.Model:
    """Turns a parallel model back into a plain Keras model, in place (the inverse of :func:`parallelize`).

    Everything multigpu set on the model, its optimizers, its layers and
    callbacks is put back, newest first, and ``keras.saving`` is Keras's own
    again once no parallel model is left.  The model keeps its weights and
    optimizer state and trains on this process's device alone.

    Args:
        model: a model returned by :func:`parallelize`.

    Returns:
        The same model object, plain again.

    Example:
        ```python
        model = multigpu.parallelize(model)
        model.fit(x, y, batch_size=256)
        model = multigpu.unparallelize(model)   # a plain Keras model again, on this process's device
        ```
    """
    from multigpu.keras.parallel import unparallelize as _unparallelize

    return _unparallelize(model)


def list_devices() -> list[Device]:
    """The devices this machine offers: every visible GPU, then its CPU cores.

    Returns:
        ``Device`` objects; their ``spec`` is what ``devices=`` accepts.
    """
    gpus = [Device("cuda", i) for i in range(backend.gpu_count())]
    cpus = [Device("cpu", i, 1.0, (c,)) for i, c in enumerate(usable_cores())]
    return gpus + cpus


def rank() -> int:
    """This process's rank in the run (0 outside a parallel run)."""
    return _runtime.rank()


def world_size() -> int:
    """The number of devices (processes) in the run (1 outside a run)."""
    return _runtime.world_size()
