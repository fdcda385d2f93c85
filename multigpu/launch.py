"""Starting, joining and ending the processes of a run.

There is one process per device.  Three ways in:

* **plain ``python train.py``**: the first :func:`multigpu.parallelize` call
  re-runs the same command line once for every other device, with rank
  variables set (:mod:`multigpu.env`); the calling process becomes rank 0 and
  hosts the rendezvous store on 127.0.0.1 and a free port.
* **``multigpu run``**: the launcher starts every rank itself and hosts the
  store; each rank's ``parallelize`` joins.
* **``torchrun``**: ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` are set, and
  ``parallelize`` joins that group (several machines work this way).

Every process we start dies with its parent (``PR_SET_PDEATHSIG``), rank 0
waits for the others when the script ends, and a rank that fails ends the run
with a message that names it.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from multigpu import env
from multigpu.devices import Device, assign_cores, parse_devices
from multigpu.planning import validate_ratios
from multigpu.processes import die_with_parent, loopback_listener, rank_environment, stop_processes

__all__ = ["Runtime", "current", "die_with_parent", "rank", "rerun_command", "start", "world_size"]

_RUNTIME: Runtime | None = None
_DEFAULT_TIMEOUT = 60.0


@dataclass
class Runtime:
    """The process-level state of a parallel run (one per process).

    Attributes:
        rank: this process's rank.
        world_size: number of processes (devices).
        devices: every rank's device, in rank order.
        ratios: the initial ratios, one per rank.
        mode: ``"single"``, ``"parallelize"``, ``"run"`` or ``"torchrun"``.
        timeout: seconds a collective may wait.
    """

    rank: int
    world_size: int
    devices: list[Device]
    ratios: list[float]
    mode: str
    timeout: float
    children: list[subprocess.Popen] = field(default_factory=list)
    quota: object | None = None

    @property
    def device(self) -> Device:
        return self.devices[self.rank]

    @property
    def backend(self) -> str:
        return "nccl" if all(d.is_cuda for d in self.devices) else "gloo"

    @property
    def torch_device(self):
        import torch

        return torch.device(f"cuda:{self.device.index}" if self.device.is_cuda else "cpu")

    def describe(self) -> str:
        """One line naming the devices and their shares."""
        total = sum(self.ratios)
        parts = [f"{d.label} {r / total:.0%}" for d, r in zip(self.devices, self.ratios)]
        return f"multigpu: {self.world_size} device(s): " + ", ".join(parts)


def current() -> Runtime | None:
    """The runtime of this process, or None before ``parallelize``."""
    return _RUNTIME


def rank() -> int:
    """This process's rank: 0 outside a parallel run."""
    if _RUNTIME is not None:
        return _RUNTIME.rank
    for name in (env.RANK, "RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def world_size() -> int:
    """Number of processes in the run: 1 outside a parallel run."""
    if _RUNTIME is not None:
        return _RUNTIME.world_size
    for name in (env.WORLD_SIZE, "WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def rerun_command() -> list[str]:
    """The command line that runs this program again (for the other ranks).

    Raises:
        RuntimeError: in an interactive session, where there is no script.
    """
    argv = list(getattr(sys, "orig_argv", []))[1:]
    interactive = hasattr(sys, "ps1") or "ipykernel" in sys.modules or not argv
    if not interactive and argv[0] not in ("-c", "-m") and not argv[0].startswith("-"):
        interactive = not os.path.exists(argv[0])
    if "_pytest" in sys.modules and not interactive:
        raise RuntimeError(
            "multigpu.parallelize() would start the other devices by running "
            "pytest again. In tests, run the training script in a subprocess "
            "(or under `multigpu run`), or use a single device."
        )
    if interactive:
        raise RuntimeError(
            "multigpu.parallelize() starts the other devices by running this "
            "program again, and an interactive session cannot be re-run. Put "
            "the code in a script and run it with `python train.py`, "
            "`multigpu run --devices ... train.py`, or `torchrun`."
        )
    from multigpu import rank_entry

    return rank_entry.command([sys.executable, *argv])


def _resolve(devices, ratios, timeout) -> tuple[list[Device], list[float], float]:
    if os.environ.get(env.DEVICES):
        devices = os.environ[env.DEVICES]
    if os.environ.get(env.TIMEOUT):
        timeout = float(os.environ[env.TIMEOUT])
    parsed = assign_cores(parse_devices(devices))
    if ratios is None or (isinstance(ratios, str) and ratios == "auto"):
        ratios = [1.0] * len(parsed)
    ratios = validate_ratios(ratios, len(parsed))
    if timeout is None:
        timeout = _DEFAULT_TIMEOUT
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"`timeout` must be a positive number of seconds. Received: timeout={timeout!r}")
    return parsed, ratios, float(timeout)


def _bind(device: Device, runtime: Runtime) -> None:
    import torch

    if device.is_cuda:
        torch.cuda.set_device(device.index)
        return
    if device.cores:
        try:
            os.sched_setaffinity(0, device.cores)
        except (AttributeError, OSError):  # pragma: no cover - non-Linux
            pass
        torch.set_num_threads(len(device.cores))
    if device.speed < 1.0:
        from multigpu.throttle import CpuQuota

        quota = CpuQuota(device.speed, len(device.cores) or 1)
        quota.apply()
        runtime.quota = quota


def start(devices=None, ratios=None, timeout: float | None = None) -> Runtime:
    """Starts or joins the run and binds this process to its device.

    Args:
        devices: device specification (see :func:`multigpu.devices.parse_devices`).
        ratios: one weight per device, or None for equal shares.
        timeout: seconds a collective may wait before the run fails.

    Returns:
        This process's :class:`Runtime`.
    """
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    if os.environ.get(env.RANK) is not None:
        runtime = _join_launched(devices, ratios, timeout)
    elif all(os.environ.get(v) for v in env.TORCHRUN_VARS):
        runtime = _join_torchrun(devices, ratios, timeout)
    else:
        parsed, ratios_, timeout_ = _resolve(devices, ratios, timeout)
        runtime = Runtime(0, len(parsed), parsed, ratios_, "single", timeout_)
        if len(parsed) > 1:
            runtime.mode = "parallelize"
            _launch_children(runtime)
    _bind(runtime.device, runtime)
    _RUNTIME = runtime
    return runtime


def _init_group(runtime: Runtime, store, destroy_at_exit: bool = True) -> None:
    import torch.distributed as dist

    kwargs = {"backend": runtime.backend, "rank": runtime.rank, "world_size": runtime.world_size}
    kwargs["timeout"] = datetime.timedelta(seconds=runtime.timeout)
    if store is not None:
        kwargs["store"] = store
    if runtime.device.is_cuda:
        import torch

        kwargs["device_id"] = torch.device(f"cuda:{runtime.device.index}")
    dist.init_process_group(**kwargs)
    sys.excepthook = _note_failure(sys.excepthook)
    if destroy_at_exit:
        atexit.register(_destroy_group)


_FAILED = False


def _note_failure(hook):
    def excepthook(exc_type, exc, tb):
        global _FAILED
        _FAILED = True
        hook(exc_type, exc, tb)
    return excepthook


def _destroy_group() -> None:
    """Leaves the group at exit: together with the others when all went well.

    A barrier first, so that no rank tears down its connections while a peer
    still uses them (gloo aborts the peer otherwise); skipped after an error,
    when the others may be gone.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            if not _FAILED:
                dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass


def _launch_children(runtime: Runtime) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    command = rerun_command()
    listener = loopback_listener()
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, runtime.world_size, True,
        datetime.timedelta(seconds=runtime.timeout),
        wait_for_workers=False, master_listen_fd=listener.fileno(),
    )
    for r in range(1, runtime.world_size):
        child_env = dict(os.environ)
        child_env.update(rank_environment(r, runtime.devices, None, port, runtime.timeout))
        runtime.children.append(
            subprocess.Popen(command, env=child_env, preexec_fn=die_with_parent)
        )
    _Supervisor(runtime).install()
    _init_group(runtime, store, destroy_at_exit=False)  # the supervisor does it
    runtime._listener = listener  # type: ignore[attr-defined] - keep the fd open


def _join_launched(devices, ratios, timeout) -> Runtime:
    import torch.distributed as dist

    launcher = os.environ.get(env.LAUNCHER_PID, "")
    if launcher.isdigit() and os.getppid() != int(launcher):
        sys.exit(1)  # the launcher died before we could ask to die with it
    parsed, ratios_, timeout_ = _resolve(devices, ratios, timeout)
    rank_ = int(os.environ[env.RANK])
    size = int(os.environ[env.WORLD_SIZE])
    if size != len(parsed):
        raise ValueError(
            f"The run has {size} processes but {len(parsed)} devices: "
            f"{[d.spec for d in parsed]}. Give one device per process."
        )
    runtime = Runtime(rank_, size, parsed, ratios_, "run", timeout_)
    store = dist.TCPStore(
        os.environ[env.MASTER_ADDR], int(os.environ[env.MASTER_PORT]), size, False,
        datetime.timedelta(seconds=timeout_),
    )
    _init_group(runtime, store)
    return runtime


def _join_torchrun(devices, ratios, timeout) -> Runtime:
    rank_ = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    from multigpu.devices import cuda_device_count

    if devices is None or devices == "auto" or (isinstance(devices, (list, tuple)) and list(devices) == ["auto"]):
        kind = "cuda" if cuda_device_count() else "cpu"
        devices = [f"{kind}:{i}" for i in range(local_size)]
    local = assign_cores(parse_devices(devices))
    if len(local) == size:
        mine = local[rank_]
    elif len(local) == local_size:
        mine = local[local_rank]
    else:
        raise ValueError(
            f"Under torchrun, `devices` lists either every rank's device ({size}) "
            f"or this machine's ({local_size}). Received {len(local)}: {[d.spec for d in local]}"
        )
    if ratios is None or ratios == "auto":
        ratios = [1.0] * size
    ratios_ = validate_ratios(ratios, size)
    timeout_ = float(timeout or os.environ.get(env.TIMEOUT) or _DEFAULT_TIMEOUT)
    # Every rank's device is known only to its own machine: gather them.
    runtime = Runtime(rank_, size, [mine] * size, ratios_, "torchrun", timeout_)
    _init_group(runtime, None)
    import torch.distributed as dist

    specs: list[str | None] = [None] * size
    dist.all_gather_object(specs, mine.spec)
    runtime.devices = [
        mine if r == rank_ else parse_devices([s], num_gpus=10**6)[0] for r, s in enumerate(specs)
    ]
    return runtime


class _Supervisor:
    """Watches the ranks rank 0 started, and ends them with rank 0.

    If a rank exits with an error while rank 0 is still running, it reports
    the rank and device, gives rank 0 a few seconds to fail on its own (a
    collective with a dead peer raises), then ends the whole run.
    """

    GRACE = 5.0

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.failed = False
        self.reported: set[int] = set()
        self._previous_hook = sys.excepthook

    def install(self) -> None:
        sys.excepthook = self._excepthook
        atexit.register(self.finish)
        threading.Thread(target=self._watch, name="multigpu-supervisor", daemon=True).start()
        try:
            signal.signal(signal.SIGTERM, self._on_signal)
            # Ctrl-C raises KeyboardInterrupt in the main thread, but only once
            # it is back in Python: a rank waiting in a collective is not.  The
            # wakeup fd tells a thread at once, which ends the run if the main
            # thread has not within a grace period.
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            threading.Thread(target=self._watch_signals, args=(read_fd,), daemon=True,
                             name="multigpu-signals").start()
        except ValueError:  # pragma: no cover - not the main thread
            pass

    def _watch_signals(self, read_fd: int) -> None:
        while True:
            data = os.read(read_fd, 1)
            if not data:
                return
            if data[0] == signal.SIGINT:
                self.failed = True
                time.sleep(self.GRACE)
                print("multigpu: interrupted; stopping every rank.", file=sys.stderr, flush=True)
                self.kill_children(grace=2.0)
                os._exit(130)

    def _on_signal(self, signum, frame) -> None:
        self.failed = True
        self.kill_children(grace=2.0)
        os._exit(128 + signum)

    def _excepthook(self, exc_type, exc, tb) -> None:
        self.failed = True
        self._previous_hook(exc_type, exc, tb)

    def _describe(self, r: int, code: int) -> str:
        dev = self.runtime.devices[r]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"multigpu: rank {r} ({dev.label}) {how}."

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            for r, child in enumerate(self.runtime.children, start=1):
                code = child.poll()
                if code not in (None, 0) and r not in self.reported:
                    self.reported.add(r)
                    print(self._describe(r, code) + " Stopping the run.", file=sys.stderr, flush=True)
                    time.sleep(self.GRACE)
                    self.kill_children(grace=1.0)
                    os._exit(1)

    def kill_children(self, grace: float) -> None:
        stop_processes(self.runtime.children, grace)

    def finish(self) -> None:
        """Leaves the group with the others, waits for them, names any that failed."""
        global _FAILED
        _FAILED = _FAILED or self.failed
        _destroy_group()
        wait = 3.0 if self.failed else self.runtime.timeout
        deadline = time.monotonic() + wait
        for c in self.runtime.children:
            try:
                c.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        bad = [(r, c.returncode) for r, c in enumerate(self.runtime.children, start=1) if c.returncode]
        self.kill_children(grace=2.0)
        for r, code in bad:
            if r not in self.reported:
                self.reported.add(r)
                print(self._describe(r, code), file=sys.stderr, flush=True)
        if bad and not self.failed:
            sys.stdout.flush()
            os._exit(1)
