"""``parallelize``'s arguments, checked and read: a bad value gets an error that says what was received and what
is allowed, before any process starts."""

from __future__ import annotations

import os

from multigpu import env
from multigpu.planning.shares import RatioSpec, validate_ratios
from multigpu.runtime import runtime as _runtime

__all__ = [
    "TRANSPORTS",
    "as_given",
    "bucket_mb",
    "check_caps",
    "check_flag",
    "check_model",
    "check_sharding",
    "devices_differ",
    "megabytes",
    "min_devices",
    "ratios_from_profile",
    "ratios_text",
    "shard_by_default",
    "switch",
]

TRANSPORTS = ("auto", "shm", "gloo")


def check_model(model) -> None:
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError("multigpu.parallelize() takes a Keras 3 model (keras.Model, Sequential, functional or "
                        f"subclassed). Received: {type(model).__name__}")
    from multigpu.keras.parallel import is_parallel

    if is_parallel(model):
        raise ValueError("multigpu.parallelize() was already called on this model. Call it once per model; the "
                         "returned model is the same object.")


def check_flag(name: str, value, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        allowed = "True, False or None" if allow_none else "True or False"
        raise TypeError(f"`{name}` must be {allowed}. Received: {name}={value!r}")


SHARD_LEVELS = ("optimizer", "gradients", "weights")


def shard_level(shard, shard_optimizer, facts) -> str | bool | None:
    """``parallelize``'s ``shard`` and ``shard_optimizer`` as one choice: ``"optimizer"``, ``"gradients"``,
    ``"weights"``, False (the whole state on every device) or None (chosen by :func:`shard_by_default`)."""
    check_flag("shard_optimizer", shard_optimizer, allow_none=True)
    if shard is None:
        return None if shard_optimizer is None else ("optimizer" if shard_optimizer else False)
    if shard not in SHARD_LEVELS:
        raise ValueError(f"`shard` must be one of {', '.join(map(repr, SHARD_LEVELS))} or None. "
                         f"Received: shard={shard!r}")
    if shard_optimizer is False:
        raise ValueError(f"`shard={shard!r}` puts the optimizer state in parts, and `shard_optimizer=False` keeps it "
                         f"whole: give one of them. Received: shard={shard!r}, shard_optimizer=False")
    if shard == "weights" and not facts.shard_weights:
        raise ValueError(f"`shard='weights'` (each device holding a part of the weights while fit runs, ZeRO stage "
                         f"3) runs on the torch backend; on the {facts.name} backend use shard='optimizer'. "
                         f"Received: shard='weights' with KERAS_BACKEND={facts.name}")
    if shard == "gradients" and not facts.shard_gradients:
        raise ValueError(f"`shard='gradients'` runs on the torch backend; on the {facts.name} backend use "
                         f"shard='optimizer'. Received: shard='gradients' with KERAS_BACKEND={facts.name}")
    return shard


def check_streaming(level, *, compression, sync_batchnorm: bool, overlap) -> None:
    """Refuses ``shard="gradients"`` (and ``"weights"``) beside what writes the gradients after the backward pass
    instead."""
    if level not in ("gradients", "weights"):
        return
    given = [f"{name}={value!r}" for name, value, on in (
        ("compression", compression, compression is not None), ("sync_batchnorm", sync_batchnorm, sync_batchnorm),
        ("overlap", overlap, bool(overlap))) if on]
    if given:
        raise ValueError(f"`shard={level!r}` writes each gradient into the sum during the backward pass, which "
                         f"{', '.join(given)} does not allow (the step writes its gradients after the pass there). "
                         f"Received: shard={level!r}, {', '.join(given)}. Use shard='optimizer'.")


def check_sharding(level, min_devices, facts) -> None:
    """Refuses the state in parts (``level``, from :func:`shard_level`) where it cannot run."""
    given = f"shard={level!r}" if level in ("gradients", "weights") else "shard_optimizer=True"
    if level and not facts.shard_optimizer:
        raise ValueError(f"`{given}` runs on the torch, TensorFlow and JAX backends; on the "
                         f"{facts.name} backend every device holds the whole optimizer state. Received: "
                         f"{given} with KERAS_BACKEND={facts.name}")
    if level and min_devices is not None:
        raise ValueError(f"`{given}` cannot go with `min_devices`: the optimizer state of a lost "
                         f"device's part of the weights would be lost with it. Received: {given}, "
                         f"min_devices={min_devices}")


def shard_by_default(transport: str, shrinks: bool, facts, streams: bool = True) -> str | bool:
    """``shard=None, shard_optimizer=None``: the state in parts where it was measured faster and smaller, ranks of
    one machine summing through shared memory (``benchmarks/optimizer_sharding/``), and the gradients too where
    the backend streams them (torch: about one copy of the gradients less, as fast; ``streams``: no compression,
    global BatchNorm statistics or sums during the backward pass, which write them after it); not where a lost device
    would take its part along (``min_devices``) or where the new weights' collective doubles the bytes on a
    link it was not measured on (gloo between machines, NCCL, JAX's XLA sums)."""
    if not facts.shard_optimizer or not facts.shard_by_default or transport != "shm" or shrinks:
        return False
    return "gradients" if facts.shard_gradients and streams else "optimizer"


def check_caps(max_batch, n: int):
    if max_batch is None:
        return None
    caps = list(max_batch)
    if len(caps) != n or not all(c is None or (isinstance(c, int) and not isinstance(c, bool) and c >= 1)
                                 for c in caps):
        raise ValueError(f"`max_batch` takes one positive integer (or None) per device ({n} devices). "
                         f"Received: max_batch={max_batch!r}")
    return caps


def devices_differ(devices, facts) -> bool:
    """Whether the devices may differ in speed: kinds or speed factors differ, or GPUs of other models."""
    if len({(d.kind, d.speed) for d in devices}) > 1:
        return True
    if devices and devices[0].is_cuda:
        try:
            return len({facts.gpu_info(d.index)["name"] for d in devices}) > 1
        except Exception:  # a GPU the framework cannot describe: take them as alike
            return False
    return False


def ratios_from_profile(spec: RatioSpec, n: int) -> tuple[RatioSpec, bool]:
    """A profile path read into fixed ratios; an unusable one falls back to measuring."""
    from multigpu._warn import warn_user
    from multigpu.balancing.profiles import ProfileError, read_profile

    try:
        values = read_profile(spec.path)["ratios"]
        return RatioSpec("fixed", tuple(validate_ratios(values, n))), False
    except (ProfileError, ValueError) as exc:
        if _runtime.rank() == 0:
            warn_user(f"multigpu: cannot use the profile ({exc}); calibrating instead.")
        return RatioSpec("auto"), True


def switch(variable: str):
    """Reads a ``0``/``1`` variable as a bool."""
    def parse(text: str) -> bool:
        if text not in ("0", "1"):
            raise ValueError(f"{variable} must be 0 or 1. Received: {variable}={text!r}")
        return text == "1"
    return parse


def megabytes(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{env.BUCKET_MB} is a bucket size in MiB, a number above 0. Received: {text!r}") from None


def bucket_mb(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`bucket_mb` is a bucket size in MiB, a number above 0. Received: bucket_mb={value!r}")
    return float(value)


def as_given(ratios):
    """Ratios as the caller gave them, numbers as floats (to compare with a variable's); None stays None."""
    if ratios is None or isinstance(ratios, os.PathLike):
        return ratios
    if isinstance(ratios, str):
        return ratios_text(ratios)
    try:
        return [float(r) for r in ratios]
    except (TypeError, ValueError):
        return ratios  # parse_ratios says what is wrong with them


def ratios_text(text: str):
    """A ``MULTIGPU_RATIOS`` value as :func:`as_given` gives an argument: ``auto`` or a path stays text."""
    try:
        return [float(r) for r in text.split(",")]
    except ValueError:
        return text


def min_devices(value, n: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= n:
        raise ValueError(f"`min_devices` is the fewest devices the run goes on with: an integer from 1 to the "
                         f"{n} devices. Received: min_devices={value!r}")
    return value
