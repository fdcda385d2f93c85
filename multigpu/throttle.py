"""Simulated slower and smaller devices: limit a process's CPU bandwidth with a cgroup, its memory with a
resource limit.

``cpu:1@0.5`` runs rank 1 at half of its cores' bandwidth.  The limit is a
Linux cgroup CPU quota: ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` on cgroup
v1, ``cpu.max`` on cgroup v2.  It needs write access to the cgroup tree
(normally root).  Every group we make is named ``multigpu.<pid>`` and removed
when the process exits.

``cpu:0/2GiB`` gives rank 0 2 GiB of memory: :func:`limit_memory` sets the
process's ``RLIMIT_DATA`` (its private writable memory: the heap and the
anonymous mappings every large allocation gets) to what it holds at that
moment plus 2 GiB.  An allocation beyond it fails in the allocator, so
torch raises its own out-of-memory error (``DefaultCPUAllocator: can't
allocate memory``), as a full GPU makes it raise ``torch.OutOfMemoryError``.
What the process held before (the interpreter, Keras, the script's arrays)
is not counted; shared memory (``multigpu.load_once``) and file mappings are
not counted either.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

__all__ = ["CpuQuota", "QuotaError", "cgroup_status", "give_back_memory", "limit_memory", "map_large_blocks",
           "memory_limit",
           "private_memory", "remove_group_of", "reset_peak_memory", "resident_memory"]

_ROOT = Path("/sys/fs/cgroup")
_PERIOD_US = 10_000  # short, so a throttled process cannot run far ahead in a burst after idling


class QuotaError(RuntimeError):
    """The CPU quota for a simulated slower device could not be set."""


def _status(field: str) -> int:
    """A size in bytes from ``/proc/self/status`` (0 where it is not there)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def private_memory() -> int:
    """Bytes of private writable memory this process holds (``VmData``: what ``RLIMIT_DATA`` counts)."""
    return _status("VmData")


def memory_limit() -> int | None:
    """The ``RLIMIT_DATA`` this process runs under, in bytes (None: none)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def resident_memory() -> tuple[int, int, int]:
    """``(resident bytes now, the peak since the last reset_peak_memory, resident bytes of files and shared
    memory now)`` of this process: the peak less the growth of the last is what its allocations took."""
    return _status("VmRSS"), _status("VmHWM"), _status("RssFile") + _status("RssShmem")


def reset_peak_memory() -> None:
    """Starts the peak of :func:`resident_memory` again from now (Linux's ``clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # pragma: no cover - an old kernel: the peak since the start stays an upper bound
        pass


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:  # pragma: no cover - not glibc
        return None


def give_back_memory() -> None:
    """Returns the allocator's free memory to the system (glibc's ``malloc_trim``), so that what a failed
    allocation's pass held no longer counts against the limit."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def map_large_blocks() -> None:
    """Blocks of 1 MiB and more mapped on their own from now on (glibc's ``M_MMAP_THRESHOLD``, which otherwise
    grows with the blocks freed): a freed tensor's memory goes back at once, as on a GPU's allocator, instead of
    staying in the heap (where ``RLIMIT_DATA`` still counts it, and the process's resident memory keeps it)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def limit_memory(size: int) -> int:
    """Lets this process hold at most ``size`` more bytes of private memory than now; returns the limit.

    Blocks of 1 MiB and more are mapped on their own (:func:`map_large_blocks`).
    """
    import resource

    map_large_blocks()
    limit = private_memory() + int(size)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def _own_cgroup_path(controller: str | None) -> str:
    """This process's path in the hierarchy of ``controller`` (None: v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller is None and controllers == "":
            return path
        if controller is not None and controller in controllers.split(","):
            return path
    raise QuotaError(f"this process is in no cgroup with the {controller or 'v2'} controller")


def _v1_cpu_root() -> Path | None:
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        root = _ROOT / name
        if (root / "cpu.cfs_quota_us").exists():
            return root
    return None


def _v2_root() -> Path | None:
    for root in (_ROOT, _ROOT / "unified"):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return root
    return None


def cgroup_status() -> str:
    """A one-line description of what throttling can use here."""
    if _v1_cpu_root() is not None:
        return f"cgroup v1 cpu controller at {_v1_cpu_root()}"
    if _v2_root() is not None:
        return f"cgroup v2 with the cpu controller at {_v2_root()}"
    return "no writable cgroup cpu controller found"


class CpuQuota:
    """Limits one process to ``fraction`` of ``num_cores`` cores.

    Args:
        fraction: share of bandwidth to keep, in (0, 1].
        num_cores: cores the process is bound to.

    Example:
        >>> quota = CpuQuota(0.5, 1)
        >>> quota.apply()      # this process now runs at half a core
        >>> quota.remove()
    """

    def __init__(self, fraction: float, num_cores: int) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"`fraction` must be in (0, 1]. Received: fraction={fraction}")
        self.fraction = fraction
        self.num_cores = max(1, num_cores)
        self._group: Path | None = None
        self._parent_procs: Path | None = None

    @property
    def quota_us(self) -> int:
        return max(1000, round(self.fraction * self.num_cores * _PERIOD_US))

    def apply(self, pid: int | None = None) -> None:
        """Moves ``pid`` (default: this process) into a new limited group.

        Raises:
            QuotaError: when no cgroup CPU controller can be written, with the
                reason.
        """
        pid = pid or os.getpid()
        name = f"multigpu.{pid}"
        try:
            root = _v1_cpu_root()
            if root is not None:
                parent = root / _own_cgroup_path("cpu").lstrip("/")
                group = parent / name
                group.mkdir(exist_ok=True)
                (group / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
            else:
                root = _v2_root()
                if root is None:
                    raise QuotaError(cgroup_status())
                parent = root / _own_cgroup_path(None).lstrip("/")
                group = parent / name
                group.mkdir(exist_ok=True)
                (group / "cpu.max").write_text(f"{self.quota_us} {_PERIOD_US}")
            (group / "cgroup.procs").write_text(str(pid))
        except QuotaError as exc:
            raise QuotaError(
                f"Cannot limit the CPU of process {pid} to {self.fraction:g} of "
                f"{self.num_cores} core(s) for a simulated slower device: {exc}. "
                "Run as root on Linux with the cgroup cpu controller, or drop "
                "the '@F' speed factor from the device."
            ) from None
        except OSError as exc:
            raise QuotaError(
                f"Cannot limit the CPU of process {pid} to {self.fraction:g} of "
                f"{self.num_cores} core(s) for a simulated slower device: {exc}. "
                "Run as root on Linux with a writable cgroup cpu controller "
                f"({cgroup_status()}), or drop the '@F' speed factor."
            ) from None
        self._group = group
        self._parent_procs = parent / "cgroup.procs"
        atexit.register(self.remove)

    def set_fraction(self, fraction: float) -> None:
        """Changes the limit of an applied quota (e.g. a mid-run slowdown)."""
        if self._group is None:
            raise QuotaError("the quota has not been applied")
        self.fraction = fraction
        if (self._group / "cpu.cfs_quota_us").exists():
            (self._group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        else:
            (self._group / "cpu.max").write_text(f"{self.quota_us} {_PERIOD_US}")

    def remove(self) -> None:
        """Moves the process back to its parent group and deletes the group."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            procs = (group / "cgroup.procs").read_text().split()
            for p in procs:
                try:
                    self._parent_procs.write_text(p)  # type: ignore[union-attr]
                except OSError:
                    pass
            group.rmdir()
        except OSError:
            pass


def remove_group_of(pid: int) -> None:
    """Removes the group a throttled process ``pid`` left behind (it was killed before it could).

    The supervisor calls it for every rank that has ended; a group that
    still holds a process, or none at all, is left alone.
    """
    name = f"multigpu.{pid}"
    candidates = []
    try:
        if _v1_cpu_root() is not None:
            candidates.append(_v1_cpu_root() / _own_cgroup_path("cpu").lstrip("/") / name)
        elif _v2_root() is not None:
            candidates.append(_v2_root() / _own_cgroup_path(None).lstrip("/") / name)
    except (OSError, QuotaError):
        return
    for group in candidates:  # the rank was started in the supervisor's own group
        try:
            group.rmdir()
        except OSError:
            pass
