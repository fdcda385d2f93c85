"""This process's place in a run: starting, joining and ending it.

There is one process per device.  Three ways in:

* **plain ``python train.py``** with several devices: the first
  :func:`multigpu.parallelize` call turns this process into the run's
  :class:`~multigpu.runtime.supervisor.Supervisor`, which runs the same
  command line once per device and exits with the run's exit code; the code
  after ``parallelize`` runs in the ranks only;
* **``multigpu run``**: the command line is the supervisor; each rank's
  ``parallelize`` joins the run from the variables it set;
* **``torchrun``** (several machines): ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
  are set, and ``parallelize`` joins that group.

A rank that fails says why (for the supervisor's message) and ends at once:
every error of a collective, a timeout included, is fatal, because the
process group it broke must never be used again.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass

from multigpu import backend, env
from multigpu.devices import Device, assign_cores, parse_devices
from multigpu.failure import fail, failed, identify, note_failure, note_thread_failure
from multigpu.runtime.processes import command

__all__ = ["Runtime", "current", "fail", "rank", "rerun_command", "start", "world_size"]

DEFAULT_TIMEOUT = 60.0
_RUNTIME: Runtime | None = None


@dataclass
class Runtime:
    """Process facts of a run (one per process); shares live in the balancer.

    Attributes:
        rank: this process's rank.
        world_size: number of processes (devices).
        devices: every rank's device, in rank order.
        mode: ``"single"``, ``"launched"`` (by multigpu's supervisor) or ``"torchrun"``.
        timeout: seconds a collective may wait.
    """

    rank: int
    world_size: int
    devices: list[Device]
    mode: str
    timeout: float

    @property
    def device(self) -> Device:
        """This rank's device."""
        return self.devices[self.rank]

    @property
    def same_host(self) -> bool:
        """True when every rank runs on this machine (not under a multi-machine torchrun)."""
        if self.mode != "torchrun":
            return True
        return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == self.world_size


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
    """The command line that runs this program again as a rank.

    Raises:
        RuntimeError: in an interactive session or under pytest, where the
            program cannot be run again.
    """
    argv = list(getattr(sys, "orig_argv", []))[1:]
    interactive = hasattr(sys, "ps1") or "ipykernel" in sys.modules or not argv
    if not interactive and argv[0] not in ("-c", "-m") and not argv[0].startswith("-"):
        interactive = not os.path.exists(argv[0])
    if "_pytest" in sys.modules and not interactive:
        raise RuntimeError(
            "multigpu.parallelize() would start the other devices by running pytest again. In tests, run "
            "the training script in a subprocess (or under `multigpu run`), or use a single device."
        )
    if interactive:
        raise RuntimeError(
            "multigpu.parallelize() starts the other devices by running this program again, and a notebook or "
            "an interactive session cannot be run again. Put the training in a function and run it on every "
            "device with multigpu.launch:\n\n"
            "    def train():\n"
            "        model = multigpu.parallelize(build_model())\n"
            "        ...\n"
            "        return model.fit(x, y, batch_size=256).history\n\n"
            "    history = multigpu.launch(train, devices=[\"cpu:0\", \"cpu:1\"])\n\n"
            "(or put the code in a script and run it with `python train.py` or `multigpu run`)."
        )
    return command([sys.executable, *argv])


def _timeout(value) -> float:
    if os.environ.get(env.TIMEOUT):
        value = float(os.environ[env.TIMEOUT])
    if value is None:
        return DEFAULT_TIMEOUT
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`timeout` must be a positive number of seconds. Received: timeout={value!r}")
    return float(value)


def planned_devices(devices=None) -> list[Device]:
    """The devices the run will have, without starting anything (for checks before the start).

    Under torchrun only this machine's are known, so None is returned there.
    """
    if os.environ.get(env.RANK) is not None:
        return parse_devices(os.environ[env.DEVICES], num_gpus=backend.gpu_count)
    if all(os.environ.get(v) for v in env.TORCHRUN_VARS):
        return None
    return parse_devices(os.environ.get(env.DEVICES) or devices, num_gpus=backend.gpu_count)


def start(devices=None, timeout: float | None = None) -> Runtime:
    """Starts, joins or (for several devices in a plain script) supervises the run.

    Args:
        devices: device specification (see :func:`multigpu.devices.parse_devices`).
        timeout: seconds a collective may wait before the run fails.

    Returns:
        This process's :class:`Runtime`.  In the process that supervises a
        run started from a plain script, it does not return: the process
        exits with the run's exit code.
    """
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    timeout_ = _timeout(timeout)
    if os.environ.get(env.RANK) is not None:
        runtime = _launched(timeout_)
    elif all(os.environ.get(v) for v in env.TORCHRUN_VARS):
        runtime = _torchrun(devices, timeout_)
    else:
        parsed = assign_cores(parse_devices(os.environ.get(env.DEVICES) or devices, num_gpus=backend.gpu_count),
                              warn=True)
        if len(parsed) > 1:
            _supervise(parsed, timeout_)  # exits
        runtime = Runtime(0, 1, parsed, "single", timeout_)
    _bind(runtime)
    _RUNTIME = runtime
    identify(runtime.rank, runtime.device.label)
    if runtime.world_size > 1:

        sys.excepthook = note_failure(sys.excepthook)
        threading.excepthook = note_thread_failure(threading.excepthook)
        backend.get().join(runtime)
        atexit.register(_leave)
    return runtime


def _supervise(devices: list[Device], timeout: float) -> None:
    from multigpu.runtime.supervisor import Supervisor

    command = rerun_command()
    code = Supervisor(command, devices, timeout).run()
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def _launched(timeout: float) -> Runtime:
    supervisor = os.environ.get(env.SUPERVISOR_PID, "")
    if supervisor.isdigit() and os.getppid() != int(supervisor):
        os._exit(1)  # the supervisor died before this process could ask to die with it
    parsed = assign_cores(parse_devices(os.environ[env.DEVICES], num_gpus=backend.gpu_count), warn=False)
    rank_ = int(os.environ[env.RANK])
    size = int(os.environ[env.WORLD_SIZE])
    if size != len(parsed):
        raise ValueError(f"The run has {size} processes but {len(parsed)} devices: {[d.spec for d in parsed]}. "
                         "Give one device per process.")
    return Runtime(rank_, size, parsed, "launched", timeout)


def _torchrun(devices, timeout: float) -> Runtime:
    rank_ = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if devices is None or devices == "auto" or (isinstance(devices, (list, tuple)) and list(devices) == ["auto"]):
        kind = "cuda" if backend.gpu_count() else "cpu"
        devices = [f"{kind}:{i}" for i in range(local_size)]
    local = assign_cores(parse_devices(devices, num_gpus=backend.gpu_count), warn=local_rank == 0)
    if len(local) == size:
        mine = local[rank_]
    elif len(local) == local_size:
        mine = local[local_rank]
    else:
        raise ValueError(
            f"Under torchrun, `devices` lists either every rank's device ({size}) or this machine's "
            f"({local_size}). Received {len(local)}: {[d.spec for d in local]}"
        )
    # Every rank's device is known only to its own machine: backend.join gathers them.
    return Runtime(rank_, size, [mine] * size, "torchrun", timeout)


def _bind(runtime: Runtime) -> None:

    device = runtime.device
    if not device.is_cuda and device.cores:
        try:
            os.sched_setaffinity(0, device.cores)
        except (AttributeError, OSError):  # pragma: no cover - non-Linux
            pass
    if not device.is_cuda and device.speed < 1.0:
        from multigpu.throttle import CpuQuota

        CpuQuota(device.speed, len(device.cores) or 1).apply()
    backend.get().bind(device)


def _leave() -> None:
    """Leaves the run at exit: with the others when all went well (a barrier), at once after a failure."""

    backend.get().leave(failed=failed())
