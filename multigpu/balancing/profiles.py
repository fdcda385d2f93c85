"""Profiles: measured speeds and shares kept in a JSON file between runs.

An entry is keyed by the model's signature (the Keras backend, the model's
class, weight paths, shapes and dtypes) and the device list, so the next run
of the same model on the same devices and backend starts from the shares the
last one found (the same model computes at other speeds on another backend:
TensorFlow ran the demo's convnet at 3.3 times torch's samples/s).  Nothing is ever
unpickled: profiles are JSON, written atomically (temporary file, rename).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ProfileError", "default_profile_path", "model_signature", "profile_key", "read_profile", "write_profile"]

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used, with the reason."""


def default_profile_path() -> Path:
    """``$MULTIGPU_PROFILE``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, then ``multigpu/profiles.json``."""
    from multigpu import env

    explicit = env.get(env.PROFILE)
    if explicit:
        return Path(explicit)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "multigpu" / "profiles.json"


def model_signature(model) -> str:
    """A short hash of the Keras backend, the model's class, weight paths, shapes and dtypes."""
    from multigpu import env

    parts = [env.keras_backend(), type(model).__name__]
    for v in model.trainable_variables:
        parts.append(f"{v.path}:{tuple(v.shape)}:{v.dtype}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def profile_key(signature: str, device_specs: Sequence[str]) -> str:
    """The entry's key: model signature and device list."""
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
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"the profile {path} is not valid JSON ({exc})") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict) or data.get("version") != PROFILE_VERSION:
        raise ProfileError(f"the profile {path} is not a multigpu profile (version {PROFILE_VERSION})")
    if key is None:
        if len(entries) != 1:
            kept = "; ".join(",".join(map(str, e.get("devices", []))) for e in entries.values() if isinstance(e, dict))
            raise ProfileError(
                f"the profile {path} has {len(entries)} entries (devices: {kept or 'none'}), and `ratios=PATH` "
                "takes a file of one entry. To use the entry of this model and these devices, pass "
                f"`ratios=\"auto\", profile=\"{path}\"` (measured and added to it where it has none); else pass "
                "an entry's \"ratios\" as a list (`ratios=[3, 1]`), or a file of one entry (`multigpu calibrate "
                "--profile NEW.json` writes one)")
        entry = next(iter(entries.values()))
    elif key not in entries:
        raise ProfileError(f"the profile {path} has no entry for this model and these devices")
    else:
        entry = entries[key]
    ratios = entry.get("ratios") if isinstance(entry, dict) else None
    if not isinstance(ratios, list) or not ratios or not all(
        isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0 for r in ratios
    ):
        raise ProfileError(f"the profile {path} has no valid ratios for this entry")
    if device_specs is not None and list(entry.get("devices", [])) != list(device_specs):
        raise ProfileError(
            f"the profile {path} was measured on devices {entry.get('devices')}, not on {list(device_specs)}"
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
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        data = {}
    data = {"version": PROFILE_VERSION, "entries": {**data.get("entries", {}), key: entry}}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)
