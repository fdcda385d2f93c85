"""Rank processes: their environment, their tie to the parent, how they are stopped, how they report.

Imports neither torch nor Keras.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence

from multigpu import backend, env

RANK_ENTRY = "multigpu.runtime.rank_entry"  # the module every rank process runs


__all__ = [
    "RANK_ENTRY",
    "command",
    "die_with_parent",
    "free_port",
    "keep_freed_memory",
    "loopback_listener",
    "rank_environment",
    "stop_processes",
]


def run_folder(kind: str) -> str:
    """A new folder ``multigpu-<kind>-<pid>-*`` in the temporary directory, for this process's run.

    Folders of the same kind left by a process that no longer exists (one
    killed with ``SIGKILL``, such as a notebook kernel that was restarted,
    cannot remove its own) are removed first.
    """
    import shutil
    import tempfile

    root = tempfile.gettempdir()
    for name in os.listdir(root):
        parts = name.split("-")
        if len(parts) >= 4 and parts[0] == "multigpu" and parts[1] == kind and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            except OSError:
                pass
    return tempfile.mkdtemp(prefix=f"multigpu-{kind}-{os.getpid()}-")


def die_with_parent() -> None:
    """Asks Linux to send SIGTERM to this process when its parent exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        pass


#: glibc's malloc in a rank: blocks under this size come from the heap, not from a mapping of their own
MMAP_THRESHOLD = 32 << 20
#: and this much free memory at the heap's top stays with the process (glibc's default: 128 KiB, then moving)
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> None:
    """Keeps the host memory a step frees for the next step (glibc's malloc; elsewhere, or where the environment
    sets glibc's malloc thresholds itself, nothing).

    A step allocates and frees host buffers of the same sizes every time (on TensorFlow the gradient vector, the
    arrays its ``numpy_function`` hands over and gets back: 2.7 MB each for an MLP of 668,000 weights).  With
    glibc's defaults, whose thresholds move as the process runs, a process may give those pages back to the
    kernel at each free and fault them in again at the next step, and whether it does depends on the order of
    its first allocations: on TensorFlow's MLP at batch 64 on two CPU devices one rank took 1,900 page faults a
    step and its step before the sum took 8.2 ms against the other rank's 4.7 ms (59 faults); about half of 17
    runs had a rank slowed so.  With blocks under :data:`MMAP_THRESHOLD` taken from the heap and up to
    :data:`TRIM_THRESHOLD` of free heap kept, both ranks took 1 to 8 faults a step in every run
    (``benchmarks/tensorflow/README.md``).
    """
    if any(env.get(name) is not None for name in env.MALLOC_SETTINGS):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (set, it no longer moves)
    mallopt(-1, TRIM_THRESHOLD)  # M_TRIM_THRESHOLD


def loopback_listener() -> socket.socket:
    """A socket listening on 127.0.0.1 on a free port (for the store)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def free_port() -> int:
    """A port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, devices: Sequence, port: int, timeout: float | None, run_dir: str,
                     ratios: str | None = None) -> dict[str, str]:
    """The environment variables that tell a started process who it is.

    Args:
        rank: the process's rank.
        devices: every rank's device.
        port: the store's port on 127.0.0.1.
        timeout: seconds a collective may wait, for a script that passes none (None: the script's or 60).
        run_dir: the folder for failure reports.
        ratios: ratios given on the command line (``multigpu run --ratios``), if any.
    """
    variables = {
        env.RANK: str(rank),
        env.WORLD_SIZE: str(len(devices)),
        env.MASTER_ADDR: "127.0.0.1",
        env.MASTER_PORT: str(port),
        env.DEVICES: ",".join(d.spec for d in devices),
        env.SUPERVISOR_PID: str(os.getpid()),
        env.RUN_DIR: run_dir,
        "KERAS_BACKEND": env.keras_backend(),
        "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    # TensorFlow's start-up lines (CPU features), once per rank of every backend (Keras imports it where installed).
    variables["TF_CPP_MIN_LOG_LEVEL"] = env.get("TF_CPP_MIN_LOG_LEVEL") or "1"
    if timeout is not None:
        variables[env.TIMEOUT] = f"{timeout:g}"
    if ratios is not None:
        variables[env.RATIOS] = ratios
    dev = devices[rank]
    # Keras's torch backend puts every tensor on its default device (the GPU, where there is one):
    # each rank names its own, so a CPU rank beside a GPU computes on its cores.
    variables["KERAS_TORCH_DEVICE"] = dev.spec.split("@")[0] if dev.is_cuda else "cpu"
    if not dev.is_cuda:
        variables["OMP_NUM_THREADS"] = str(max(1, len(dev.cores)))
    if not dev.is_cuda and dev.memory is not None:  # what the backend's allocator needs to keep within the size
        given = env.copy()
        variables.update({k: v for k, v in backend.facts().cpu_memory_environment(dev.memory).items()
                          if k not in given})
        if "MALLOC_MMAP_THRESHOLD_" not in given:  # glibc maps blocks of 1 MiB and more on their own from the
            # start, as the limit sets later (throttle.limit_memory): what the script builds before it (the
            # model's weights) goes back at once when let go (weights in parts), not to a heap the limit counts
            variables["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    return variables


def stop_processes(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every process still running, SIGKILL to those alive after ``grace`` s."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            p.terminate()
        except OSError:  # pragma: no cover - already gone
            pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def command(orig_argv: list[str]) -> list[str]:
    """The command line that runs the program of ``orig_argv`` as a rank (through :mod:`multigpu.runtime.rank_entry`).

    Args:
        orig_argv: the interpreter's own command line (``sys.orig_argv``).

    Returns:
        ``[python, *interpreter options, "-m", "multigpu.runtime.rank_entry", kind, target, *args]``.

    Raises:
        ValueError: when ``orig_argv`` names no script, module or code.
    """
    options: list[str] = []
    i = 1
    while i < len(orig_argv):
        item = orig_argv[i]
        if item in ("-c", "-m"):
            if i + 1 >= len(orig_argv):
                break
            kind = "code" if item == "-c" else "module"
            return [orig_argv[0], *options, "-m", RANK_ENTRY, kind, orig_argv[i + 1], *orig_argv[i + 2 :]]
        if item == "-":
            break  # a program read from standard input cannot be read again
        if not item.startswith("-"):
            return [orig_argv[0], *options, "-m", RANK_ENTRY, "script", item, *orig_argv[i + 1 :]]
        options.append(item)
        if item in ("-W", "-X", "--check-hash-based-pycs") and i + 1 < len(orig_argv):
            options.append(orig_argv[i + 1])
            i += 1
        i += 1
    raise ValueError(f"No script, module or code to run again in the command line {orig_argv!r}.")
