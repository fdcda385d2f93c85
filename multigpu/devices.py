"""Device discovery and parsing of device specifications.

A device is one process's compute: a CUDA GPU, or a set of CPU cores.  Users
name devices the way Keras users already do:

* ``0``, ``"0"``, ``"cuda:1"``, ``"gpu:1"``: a CUDA GPU by index;
* ``"cpu"``, ``"cpu:0"``, ``"cpu:1"``: a CPU device.  The machine's cores are
  split between the CPU devices in use, in the order they are listed;
* ``"cpu:1@0.5"``: a CPU device limited to half of its cores' bandwidth (a
  simulated slower device; see :mod:`multigpu.throttle`);
* ``"cpu:0/1536MiB"``, ``"cpu:1@0.5/2GiB"``: a CPU device with a memory of
  that size (a simulated smaller device): the operating system refuses its
  process more private memory than it held at the start plus that size
  (``RLIMIT_DATA``), so an allocation beyond it fails inside the framework,
  as on a full GPU;
* ``"auto"``: every visible GPU; on a machine without GPUs, one CPU device per
  core, at most 8 (so a 2-core machine gets ``cpu:0`` and ``cpu:1``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from multigpu import env

__all__ = ["Device", "assign_cores", "driver_gpu_count", "driver_gpu_name", "format_size", "looks_like_devices",
           "parse_devices", "parse_size", "unusable_gpus", "usable_cores"]

_SPEC = re.compile(r"^(?P<kind>cpu|cuda|gpu)(?::(?P<index>\d+))?(?:@(?P<speed>[^@/]+))?"
                   r"(?:/(?P<memory>[^@/]+))?$")
_SIZE = re.compile(r"^(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[kmgt]?i?b?)$")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_MAX_AUTO_CPU_DEVICES = 8


@dataclass(frozen=True)
class Device:
    """One device that one process trains on.

    Attributes:
        kind: ``"cpu"`` or ``"cuda"``.
        index: the GPU index, or the CPU device's number.
        speed: fraction of the device's bandwidth to use (CPU only; 1.0 = all).
        cores: the CPU cores this device is bound to (filled in by
            :func:`assign_cores`; empty for GPUs).
        memory: bytes of memory a CPU device is given (``cpu:0/2GiB``), or None: as much as the machine has.
    """

    kind: str
    index: int
    speed: float = 1.0
    cores: tuple[int, ...] = field(default=(), compare=False)
    memory: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def spec(self) -> str:
        """The canonical spelling, e.g. ``"cuda:0"`` or ``"cpu:1@0.5"``."""
        base = f"{self.kind}:{self.index}"
        base = base if self.speed == 1.0 else f"{base}@{self.speed:g}"
        return base if self.memory is None else f"{base}/{format_size(self.memory)}"

    @property
    def label(self) -> str:
        """A short display name, e.g. ``"GPU:0"`` or ``"CPU:1@0.5"``."""
        base = f"{'GPU' if self.is_cuda else 'CPU'}:{self.index}"
        return base if self.speed == 1.0 else f"{base}@{self.speed:g}"

    def __str__(self) -> str:
        return self.spec


def format_size(n: int) -> str:
    """``1610612736`` -> ``"1.5GiB"``; ``1000`` -> ``"1000B"``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and (n * 1000) % size == 0:
            return f"{n / size:g}{unit}"
    return f"{n}B"


def parse_size(text: str) -> int:
    """``"1536MiB"``, ``"2GiB"``, ``"1.5GB"``, ``"500000000"`` -> bytes.

    Raises:
        ValueError: naming what was received and what is allowed.
    """
    match = _SIZE.match(str(text).strip().lower())
    if not match or match["unit"] not in _UNITS or float(match["number"]) <= 0:
        raise ValueError(f"A memory size is a positive number with an optional unit: B, KB, MB, GB, TB (powers of "
                         f"1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 'cpu:0/1536MiB'. Received: {text!r}")
    return int(float(match["number"]) * _UNITS[match["unit"]])


def driver_gpu_count(root: str = "/proc/driver/nvidia/gpus") -> int:
    """GPUs the NVIDIA driver lists under ``root``, narrowed by ``CUDA_VISIBLE_DEVICES`` when it is set."""
    try:
        found = len(os.listdir(root))
    except OSError:
        return 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    count = 0
    for entry in visible.split(","):  # CUDA stops at the first entry it cannot use
        item = entry.strip()
        if not (item.isdigit() and int(item) < found):
            break
        count += 1
    return count


def driver_gpu_name(index: int, root: str = "/proc/driver/nvidia/gpus") -> str:
    """The model the NVIDIA driver reports for its ``index``-th GPU, or ``"NVIDIA GPU"``."""
    try:
        folder = sorted(os.listdir(root))[index]
        with open(os.path.join(root, folder, "information")) as f:
            for line in f:
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    except (OSError, IndexError):
        pass
    return "NVIDIA GPU"


def usable_cores() -> list[int]:
    """The CPU cores this process may run on, sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def _parse_one(item: object, gpus: Callable[[], int]) -> Device:
    if isinstance(item, Device):
        return item
    if isinstance(item, bool) or not isinstance(item, (int, str)):
        raise ValueError(
            "Each device must be a GPU index (0, 'cuda:1', 'gpu:1') or a CPU "
            f"device ('cpu:0', 'cpu:1@0.5'). Received: {item!r} of type {type(item).__name__}"
        )
    text = str(item).strip().lower()
    if text.isdigit():
        text = f"cuda:{text}"
    match = _SPEC.match(text)
    if not match:
        raise ValueError(
            f"Unknown device {item!r}. Allowed: a GPU index (0, 'cuda:1', "
            "'gpu:1'), a CPU device ('cpu', 'cpu:0', 'cpu:1@0.5' for a device "
            "limited to half speed, 'cpu:0/2GiB' for a device with 2 GiB of memory), or 'auto'."
        )
    kind = "cuda" if match["kind"] in ("cuda", "gpu") else "cpu"
    index = int(match["index"] or 0)
    memory = None
    if match["memory"] is not None:
        if kind == "cuda":
            raise ValueError(f"A memory size ('/SIZE') is only given to CPU devices: a GPU's memory is its own. "
                             f"Received: {item!r}")
        memory = parse_size(match["memory"])
    speed = 1.0
    if match["speed"] is not None:
        if kind == "cuda":
            raise ValueError(
                f"A speed factor ('@F') is only allowed on CPU devices. Received: {item!r}"
            )
        try:
            speed = float(match["speed"])
        except ValueError:
            speed = math.nan
        if not (math.isfinite(speed) and 0 < speed <= 1):
            raise ValueError(
                f"The speed factor of {item!r} must be a number in (0, 1], "
                "e.g. 'cpu:1@0.5' for half speed."
            )
    num_gpus = gpus() if kind == "cuda" else 0
    if kind == "cuda" and index >= num_gpus:
        hint = (
            (unusable_gpus() or " This machine has no GPU: use CPU devices such as 'cpu:0', 'cpu:1'.")
            if num_gpus == 0
            else f" Visible GPUs: {', '.join(f'cuda:{i}' for i in range(num_gpus))}."
        )
        raise ValueError(f"Device {item!r} does not exist.{hint}")
    return Device(kind, index, speed, memory=memory)


def unusable_gpus() -> str:
    """Why the GPUs the NVIDIA driver lists cannot be used, when it lists some (a CPU build of torch, most
    often), else ``""``."""
    listed = driver_gpu_count()
    if not listed:
        return ""
    backend = env.keras_backend()
    return (f" The NVIDIA driver lists {listed} GPU(s), but Keras's {backend} backend cannot use them: its build "
            "has no CUDA (a CPU build of torch, jax or tensorflow). Install a CUDA build first, e.g. "
            "`pip install torch --index-url https://download.pytorch.org/whl/cu126`; `multigpu devices` shows "
            "the versions in use.")


def looks_like_devices(text: str) -> bool:
    """Whether ``text`` is a device list as the command line takes it (``0``, ``cpu:1@0.5``, ``cpu:0,cpu:1``,
    ``auto``): for telling devices apart from what follows them."""
    parts = [t.strip().lower() for t in text.split(",") if t.strip()]
    return bool(parts) and all(t == "auto" or t.isdigit() or _SPEC.match(t) for t in parts)


def parse_devices(
    devices: str | int | Sequence[str | int | Device] | None,
    *,
    num_gpus: int | Callable[[], int] | None = None,
) -> list[Device]:
    """Turns a user's device specification into a list of devices.

    Args:
        devices: ``"auto"``/``None``, one device, or a sequence of devices.
        num_gpus: the GPUs the backend can use, or a function that counts them (called only when a GPU or
            ``"auto"`` is named): ``multigpu.backend.gpu_count``.  ``None``: the NVIDIA driver's count.

    Returns:
        The devices, in rank order, without CPU cores assigned yet.

    Raises:
        ValueError: for unknown, malformed, missing or repeated devices.
    """
    def gpus() -> int:
        if num_gpus is None:
            return driver_gpu_count()
        return num_gpus() if callable(num_gpus) else num_gpus

    if isinstance(devices, (list, tuple)) and len(devices) == 1 and str(devices[0]).strip().lower() == "auto":
        devices = "auto"
    if devices is None or (isinstance(devices, str) and devices.strip().lower() == "auto"):
        if gpus():
            return [Device("cuda", i) for i in range(gpus())]
        unusable = unusable_gpus()
        if unusable and num_gpus is not None:
            from multigpu._warn import warn_user

            warn_user(f"devices='auto' takes CPU devices.{unusable}")
        count = max(1, min(len(usable_cores()), _MAX_AUTO_CPU_DEVICES))
        return [Device("cpu", i) for i in range(count)]
    if isinstance(devices, (str, int, Device)):
        if isinstance(devices, str) and "," in devices:
            devices = [d for d in devices.split(",") if d.strip()]
        else:
            devices = [devices]
    items = list(devices)
    if not items:
        raise ValueError("`devices` must name at least one device. Received: devices=[]")
    parsed = [_parse_one(item, gpus) for item in items]
    seen: dict[tuple[str, int], object] = {}
    for item, dev in zip(items, parsed):
        key = (dev.kind, dev.index)
        if key in seen:
            raise ValueError(
                f"Device {dev.kind}:{dev.index} is listed twice ({seen[key]!r} and "
                f"{item!r}). Each device may appear once. Received: devices={items!r}"
            )
        seen[key] = item
    return parsed


def assign_cores(devices: Sequence[Device], cores: Sequence[int] | None = None, *, warn: bool = True) -> list[Device]:
    """Splits the usable CPU cores between the CPU devices, in list order.

    With at least as many cores as CPU devices, each device gets a contiguous
    block of cores of nearly equal size.  With more CPU devices than cores the
    devices share cores round-robin, and a warning says so.

    Args:
        devices: devices in rank order.
        cores: the cores to split (default: this process's affinity).
        warn: warn (once, at the user's line) when CPU devices outnumber the cores.

    Returns:
        The devices with ``cores`` filled in for CPU devices.
    """
    cores = list(cores) if cores is not None else usable_cores()
    cpu_positions = [i for i, d in enumerate(devices) if d.kind == "cpu"]
    n = len(cpu_positions)
    out = list(devices)
    if n == 0:
        return out
    if n > len(cores) and warn:
        from multigpu._warn import warn_user

        warn_user(
            f"{n} CPU devices share {len(cores)} cores, so they will slow each "
            "other down. Use at most one CPU device per core for real speed-ups."
        )
    for k, pos in enumerate(cpu_positions):
        if n <= len(cores):
            block = tuple(cores[k * len(cores) // n : (k + 1) * len(cores) // n])
        else:
            block = (cores[k % len(cores)],)
        out[pos] = dataclasses.replace(out[pos], cores=block)
    return out
