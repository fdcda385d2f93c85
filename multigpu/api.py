"""The public entry points: ``parallelize`` and ``multi_gpu_model``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

from multigpu import launch
from multigpu.devices import Device, cuda_device_count, usable_cores

__all__ = ["list_devices", "multi_gpu_model", "parallelize", "rank", "world_size"]

DeviceSpec = str | int | Device


def _check_backend() -> None:
    import keras

    backend = keras.backend.backend()
    if backend != "torch":
        raise RuntimeError(
            "multigpu runs on Keras's torch backend. Set KERAS_BACKEND=torch "
            "before Keras is imported (e.g. `KERAS_BACKEND=torch python train.py`). "
            f"Received: backend={backend!r}"
        )


def _check_model(model) -> None:
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(
            "multigpu.parallelize() takes a Keras 3 model (keras.Model, "
            f"Sequential, functional or subclassed). Received: {type(model).__name__}"
        )


def parallelize(
    model,
    devices: str | DeviceSpec | Sequence[DeviceSpec] | None = None,
    ratios: str | Sequence[float] | None = None,
    *,
    timeout: float | None = None,
    sync_batchnorm: bool = False,
    rebalance: bool | None = None,
    profile: str | os.PathLike | None = None,
    recalibrate: bool = False,
    max_batch: Sequence[int | None] | None = None,
    report: bool = False,
):
    """Trains ``model`` data-parallel across ``devices``, one process each.

    Call it once, after building the model and before ``compile``/``fit``.  In
    a plain ``python train.py`` the first call starts one more process per
    extra device by running the script again; this process becomes rank 0.
    Under ``multigpu run`` or ``torchrun`` it joins the running group.

    ``fit``'s ``batch_size`` is the global batch.  It is split across the
    devices in proportion to ``ratios``, and gradients are combined weighted
    by each device's share, so the result equals one device training on the
    whole batch.

    Args:
        model: a Keras 3 model on the torch backend.
        devices: ``"auto"`` (default: every GPU; on a CPU-only machine one
            CPU device per core, at most 8), or a list such as ``[0, 1]``,
            ``["cuda:0", "cuda:1"]`` or ``["cpu:0", "cpu:1@0.5"]``.
        ratios: relative speed of each device, e.g. ``[3, 1]``; ``"auto"`` to
            measure the speeds at the first step (or take them from the
            profile); the path of a profile JSON file to reuse its ratios.
            ``None`` (default) means ``"auto"`` when the devices differ
            (kinds, GPU models or ``@F`` speed factors) and equal shares
            otherwise.
        timeout: seconds a collective may wait for another rank before the
            run fails (default 60).
        sync_batchnorm: compute BatchNormalization's batch statistics over
            the whole global batch (weighted by shares), so a BatchNorm model
            reproduces the single-device run; by default each device
            normalises over its own share and the moving statistics are
            averaged over devices.
        rebalance: move shares toward measured speeds while training
            (default: on with automatic ratios, off with given ratios).
        profile: where measured speeds are kept (default
            ``$MULTIGPU_PROFILE`` or ``~/.cache/multigpu/profiles.json``).
        recalibrate: measure again even if the profile has an entry.
        max_batch: the largest local batch each device can hold (``None``
            for no limit); the excess goes to devices with room.
        report: print, at the end of each epoch, where each device's time
            went (data, compute, waiting).

    Returns:
        The same model object, now parallel.

    Example:
        ```python
        model = multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], ratios=[3, 1])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=256, epochs=3)
        ```
    """
    _check_backend()
    _check_model(model)
    if getattr(model, "_multigpu_state", None) is not None:
        raise ValueError(
            "multigpu.parallelize() was already called on this model. Call it "
            "once per model; the returned model is the same object."
        )
    if not isinstance(sync_batchnorm, bool):
        raise TypeError(f"`sync_batchnorm` must be True or False. Received: sync_batchnorm={sync_batchnorm!r}")
    from multigpu import env

    if os.environ.get(env.RATIOS):  # `multigpu run --ratios` wins over the script
        text = os.environ[env.RATIOS]
        ratios = text if text == "auto" or text.endswith(".json") else [float(r) for r in text.split(",")]
    auto, ratios_arg = _resolve_ratios(ratios, profile)
    if rebalance is not None and not isinstance(rebalance, bool):
        raise TypeError(f"`rebalance` must be True, False or None. Received: rebalance={rebalance!r}")
    runtime = launch.start(devices, ratios_arg, timeout)
    if ratios is None and not _devices_differ(runtime.devices):
        auto = False
    caps = _check_caps(max_batch, runtime.world_size)
    from multigpu.trainer import attach

    attach(
        model, runtime, sync_batchnorm=sync_batchnorm, auto=auto,
        rebalance=auto if rebalance is None else rebalance,
        profile=None if profile is None else os.fspath(profile), recalibrate=recalibrate,
        report=report, max_batch=caps,
    )
    return model


def _resolve_ratios(ratios, profile):
    """Returns (auto, ratios for the launcher)."""
    if ratios is None:
        return True, None
    if isinstance(ratios, (str, os.PathLike)):
        text = os.fspath(ratios)
        if text == "auto":
            return True, None
        if text.endswith(".json"):
            from multigpu.calibrate import ProfileError, read_profile

            try:
                return False, read_profile(text)["ratios"]
            except ProfileError as exc:
                warnings.warn(f"multigpu: cannot use the profile ({exc}); calibrating instead.", stacklevel=3)
                return True, None
        raise ValueError(
            "`ratios` must be a list of numbers, 'auto', a profile .json path or None. "
            f"Received: ratios={ratios!r}"
        )
    return False, ratios


def _devices_differ(devices) -> bool:
    if len({(d.kind, d.speed) for d in devices}) > 1:
        return True
    if devices and devices[0].is_cuda:
        try:
            import torch

            return len({torch.cuda.get_device_name(d.index) for d in devices}) > 1
        except Exception:
            return False
    return False


def _check_caps(max_batch, n: int):
    if max_batch is None:
        return None
    caps = list(max_batch)
    if len(caps) != n or not all(c is None or (isinstance(c, int) and not isinstance(c, bool) and c >= 1)
                                 for c in caps):
        raise ValueError(
            f"`max_batch` takes one positive integer (or None) per device ({n} devices). "
            f"Received: max_batch={max_batch!r}"
        )
    return caps


def multi_gpu_model(model, gpus: int | Sequence[DeviceSpec] | str | None = None,
                    ratios: str | Sequence[float] | None = None, **kwargs):
    """Drop-in replacement for the old ``keras.utils.multi_gpu_model``.

    Args:
        model: the template model.
        gpus: a number of GPUs (the first ``gpus``), a list of GPU indices or
            any device spellings ``parallelize`` takes, or ``"auto"``. On a
            machine without GPUs, a number ``N`` gives ``N`` CPU devices.
        ratios: relative batch share per GPU, as in the community patch
            (e.g. ``[768, 560]``), or ``"auto"``; ``None`` as in ``parallelize``.
        **kwargs: the old ``cpu_merge``/``cpu_relocation`` are accepted and
            ignored (there is no merge: every device holds a full replica).

    Returns:
        The same model, parallel.  Save it directly: it is the template model.
    """
    unknown = set(kwargs) - {"cpu_merge", "cpu_relocation"}
    if unknown:
        raise TypeError(f"multi_gpu_model() got unexpected arguments: {sorted(unknown)}")
    if gpus is None:
        devices: object = "auto"
    elif isinstance(gpus, int) and not isinstance(gpus, bool):
        if gpus < 1:
            raise ValueError(f"`gpus` must be at least 1. Received: gpus={gpus}")
        kind = "cuda" if cuda_device_count() else "cpu"
        devices = [f"{kind}:{i}" for i in range(gpus)]
    elif isinstance(gpus, str):
        devices = gpus
    else:
        devices = list(gpus)
    return parallelize(model, devices=devices, ratios=ratios)


def list_devices() -> list[Device]:
    """The devices this machine offers: every visible GPU, then its CPU cores.

    Returns:
        ``Device`` objects; their ``spec`` is what ``devices=`` accepts.
    """
    gpus = [Device("cuda", i) for i in range(cuda_device_count())]
    cpus = [Device("cpu", i, 1.0, (c,)) for i, c in enumerate(usable_cores())]
    return gpus + cpus


def rank() -> int:
    """This process's rank in the run (0 outside a parallel run)."""
    return launch.rank()


def world_size() -> int:
    """The number of devices (processes) in the run (1 outside a run)."""
    return launch.world_size()
