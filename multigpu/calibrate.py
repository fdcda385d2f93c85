"""Calibration: measure each device's speed and keep it in a profile.

``ratios="auto"`` makes every rank, at the first training step, run a few
*solo* forward and backward passes on its own share of the batch (no
collective, so nobody waits for anybody), time them, and restore every
variable afterwards.  One all-reduce then gives every rank every speed, and
the shares are set in proportion.  The result is kept in a small JSON
profile keyed by the model's signature and the device set, so the next run
starts balanced.  Nothing is ever unpickled: profiles are JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "ProfileError",
    "default_profile_path",
    "model_signature",
    "profile_key",
    "read_profile",
    "solo_speed",
    "write_profile",
]

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used, with the reason."""


def default_profile_path() -> Path:
    """``$MULTIGPU_PROFILE`` or ``~/.cache/multigpu/profiles.json``."""
    explicit = os.environ.get("MULTIGPU_PROFILE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "multigpu" / "profiles.json"


def model_signature(model) -> str:
    """A short hash of the model's class, layers and weight shapes."""
    parts = [type(model).__name__]
    for v in model.trainable_variables:
        parts.append(f"{v.path}:{tuple(v.shape)}:{v.dtype}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def profile_key(signature: str, device_specs: Sequence[str]) -> str:
    return f"{signature}@{','.join(device_specs)}"


def read_profile(path: str | os.PathLike, key: str | None = None, device_specs: Sequence[str] | None = None) -> dict:
    """Reads one entry of a profile file.

    Args:
        path: the JSON file.
        key: the entry (model signature and devices); None takes the file's
            only entry.
        device_specs: when given, the entry's devices must be these.

    Returns:
        The entry: ``{"devices", "speeds", "ratios", "batch_size", ...}``.

    Raises:
        ProfileError: missing file, bad JSON, wrong shape or other devices.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"no profile at {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"the profile {path} is not valid JSON ({exc})") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict) or data.get("version") != PROFILE_VERSION:
        raise ProfileError(f"the profile {path} is not a multigpu profile (version {PROFILE_VERSION})")
    if key is None:
        if len(entries) != 1:
            raise ProfileError(f"the profile {path} has {len(entries)} entries; name one")
        entry = next(iter(entries.values()))
    elif key not in entries:
        raise ProfileError(f"the profile {path} has no entry for this model and these devices")
    else:
        entry = entries[key]
    ratios = entry.get("ratios") if isinstance(entry, dict) else None
    if not isinstance(ratios, list) or not all(isinstance(r, (int, float)) and r > 0 for r in ratios):
        raise ProfileError(f"the profile {path} has no valid ratios for this entry")
    if device_specs is not None and list(entry.get("devices", [])) != list(device_specs):
        raise ProfileError(
            f"the profile {path} was measured on devices {entry.get('devices')}, "
            f"not on {list(device_specs)}"
        )
    return entry


def write_profile(path: str | os.PathLike, key: str, entry: dict) -> None:
    """Adds or replaces one entry, atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            data = {}
    except (OSError, json.JSONDecodeError):
        data = {}
    data = {"version": PROFILE_VERSION, "entries": {**data.get("entries", {}), key: entry}}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def solo_speed(model, x, y, sample_weight, *, warmup: int = 1, min_steps: int = 2,
               min_seconds: float = 1.0, max_steps: int = 30) -> tuple[float, float]:
    """Samples/s of forward and backward passes on one local batch, alone.

    Every variable of the model (weights, BatchNorm statistics, random seed
    state) is restored afterwards, so training is unchanged.

    Returns:
        ``(samples_per_second, seconds_spent)``.
    """
    import keras
    import torch

    rows = next(int(a.shape[0]) for a in keras.tree.flatten(x) if a is not None)
    if rows == 0:
        return 0.0, 0.0
    variables = list(model.variables)
    saved = [v.value.detach().clone() for v in variables]
    began = time.perf_counter()
    timed: list[float] = []
    steps = 0
    try:
        while True:
            t0 = time.perf_counter()
            model.zero_grad()
            if model._call_has_training_arg:
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            loss.backward()
            steps += 1
            if steps > warmup:
                timed.append(time.perf_counter() - t0)
            if (len(timed) >= min_steps and sum(timed) >= min_seconds) or steps >= max_steps + warmup:
                break
    finally:
        with torch.no_grad():
            for v, s in zip(variables, saved):
                v.value.copy_(s)
        model.zero_grad()
    return rows * len(timed) / max(sum(timed), 1e-9), time.perf_counter() - began
