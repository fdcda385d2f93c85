"""This process's place in a run: starting, joining and ending it.

There is one process per device.  The ways in, each a launcher class of
:mod:`multigpu.runtime.environments`:

* **plain ``python train.py``** with several devices: the first
  :func:`multigpu.parallelize` call turns this process into the run's
  :class:`~multigpu.runtime.supervisor.Supervisor`, which runs the same
  command line once per device and exits with the run's exit code; the code
  after ``parallelize`` runs in the ranks only;
* **``multigpu run``**: the command line is the supervisor; each rank's
  ``parallelize`` joins the run from the variables it set;
* **an outside launcher** (torchrun, ``srun``, ``mpirun``, Kubernetes' torch
  variables): each process is one rank, and ``parallelize`` joins the group
  at the rendezvous its launcher gave.

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
from multigpu.log import logger as log
from multigpu.runtime import environments
from multigpu.runtime.environments import Environment
from multigpu.runtime.processes import command, keep_freed_memory

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
        environment: the launcher that started this process (None: a process alone, which supervises
            the ranks it starts itself).
        timeout: seconds a collective may wait.
    """

    rank: int
    world_size: int
    devices: list[Device]
    environment: Environment | None
    timeout: float

    @property
    def device(self) -> Device:
        """This rank's device."""
        return self.devices[self.rank]

    @property
    def same_host(self) -> bool:
        """True when every rank runs on this machine."""
        return self.environment is None or self.environment.same_host


def current() -> Runtime | None:
    """The runtime of this process, or None before ``parallelize``."""
    return _RUNTIME


def rank() -> int:
    """This process's rank: 0 outside a parallel run."""
    if _RUNTIME is not None:
        return _RUNTIME.rank
    found = _detect()
    return 0 if found is None else found.rank


def world_size() -> int:
    """Number of processes in the run: 1 outside a parallel run."""
    if _RUNTIME is not None:
        return _RUNTIME.world_size
    found = _detect()
    return 1 if found is None else found.world_size


def _detect() -> Environment | None:
    """The launcher of this process (its variables malformed: as alone, the start says why)."""
    try:
        return environments.detect(env.copy())
    except ValueError:
        return None


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


def _timeout(value, say=None) -> float:
    value = env.fallback("timeout", value, env.TIMEOUT, float, say)
    if value is None:
        return DEFAULT_TIMEOUT
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`timeout` must be a positive number of seconds. Received: timeout={value!r}")
    return float(value)


def planned_devices(devices=None) -> list[Device] | None:
    """The devices the run will have, without starting anything (for checks before the start).

    Under an outside launcher only this machine's are known, so None is returned there.
    """
    found = environments.detect(env.copy())
    if found is not None:
        return parse_devices(env.get(env.DEVICES), num_gpus=backend.gpu_count) if found.knows_every_device else None
    return parse_devices(env.fallback("devices", devices, env.DEVICES, lambda t: t.split(",")),
                         num_gpus=backend.gpu_count)


def start(devices=None, timeout: float | None = None, say=None) -> Runtime:
    """Starts, joins or (for several devices in a plain script) supervises the run.

    Args:
        devices: device specification (see :func:`multigpu.devices.parse_devices`).
        timeout: seconds a collective may wait before the run fails (None: ``MULTIGPU_TIMEOUT``, else 60).
        say: where rank 0 says what an argument changed (an argument that a launcher's variable disagrees with).

    Returns:
        This process's :class:`Runtime`.  In the process that supervises a
        run started from a plain script, it does not return: the process
        exits with the run's exit code.
    """
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    found = environments.detect(env.copy())
    say_once = say if found is None or found.rank == 0 else None
    timeout_ = _timeout(timeout, say_once)
    if found is not None and found.knows_every_device:
        runtime = _launched(found, devices, timeout_, say_once)
    elif found is not None:
        runtime = _outside(found, devices, timeout_)
    else:
        devices = env.fallback("devices", devices, env.DEVICES, lambda t: t.split(","))
        parsed = assign_cores(parse_devices(devices, num_gpus=backend.gpu_count), warn=True)
        if len(parsed) > 1:
            _supervise(parsed, timeout_)  # exits
        runtime = Runtime(0, 1, parsed, None, timeout_)
    _bind(runtime)
    _RUNTIME = runtime
    identify(runtime.rank, runtime.device.label)
    if runtime.world_size > 1:

        sys.excepthook = note_failure(sys.excepthook)
        threading.excepthook = note_thread_failure(threading.excepthook)
        backend.get().join(runtime)
        atexit.register(_leave)
    if not runtime.device.is_cuda and runtime.device.memory is not None:
        from multigpu.throttle import limit_memory

        backend.facts().warm_up()
        limit_memory(runtime.device.memory)  # after the join: the device's memory is the training's
    if found is not None and not found.knows_every_device and found.rank == 0:
        machines = found.world_size // max(1, found.local_size)
        log.info(f"started by {found.name}: {found.world_size} ranks on {machines} machine(s), "
                 f"rendezvous at {found.master_addr}:{found.master_port}")
    return runtime


def _supervise(devices: list[Device], timeout: float) -> None:
    """Turns this process into the run's supervisor: it gives back what the script loaded before
    ``parallelize`` by running a small supervisor program in its place (``exec``: the same pid, output and
    exit code; arrays of :func:`multigpu.load_once` stay open for the ranks), which starts a rank per device.
    Where ``exec`` fails, this process supervises as it is."""
    from multigpu.runtime.supervisor import Supervisor, become_supervisor

    command = rerun_command()
    sys.stdout.flush()
    sys.stderr.flush()
    become_supervisor(command, devices, timeout)  # returns only where exec failed
    code = Supervisor(command, devices, timeout).run()
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def _launched(found: Environment, devices, timeout: float, say) -> Runtime:
    """A rank of multigpu's supervisor: every rank's device is in ``MULTIGPU_DEVICES``."""
    supervisor = env.get(env.SUPERVISOR_PID, "")
    if supervisor.isdigit() and os.getppid() != int(supervisor):
        os._exit(1)  # the supervisor died before this process could ask to die with it
    text = env.get(env.DEVICES)
    parsed = assign_cores(parse_devices(text, num_gpus=backend.gpu_count), warn=False)
    if found.world_size != len(parsed):
        raise ValueError(f"The run has {found.world_size} processes but {len(parsed)} devices: "
                         f"{[d.spec for d in parsed]}. Give one device per process.")
    if say is not None and devices not in (None, "auto", ["auto"]):
        asked = [d.spec for d in parse_devices(devices, num_gpus=backend.gpu_count)]
        if asked != [d.spec for d in parsed]:
            say(f"--devices {text} (given to multigpu run or multigpu.launch) wins over devices={asked} given to "
                "parallelize: the ranks' processes run there")
    return Runtime(found.rank, found.world_size, parsed, found, timeout)


def _outside(found: Environment, devices, timeout: float) -> Runtime:
    """A rank of an outside launcher: ``devices`` (else ``MULTIGPU_DEVICES``) lists every rank's device or this
    machine's (``"auto"``: every GPU here, else one CPU device per local rank); every rank's is learnt when the
    group is joined."""
    devices = env.fallback("devices", devices, env.DEVICES, lambda t: t.split(","))
    if devices is None or devices == "auto" or (isinstance(devices, (list, tuple)) and list(devices) == ["auto"]):
        kind = "cuda" if backend.gpu_count() else "cpu"
        devices = [f"{kind}:{i}" for i in range(found.local_size)]
    local = assign_cores(parse_devices(devices, num_gpus=backend.gpu_count), warn=found.local_rank == 0)
    if len(local) == found.world_size:
        mine = local[found.rank]
    elif len(local) == found.local_size:
        mine = local[found.local_rank]
    else:
        raise ValueError(
            f"Under {found.name}, `devices` lists either every rank's device ({found.world_size}) or this "
            f"machine's ({found.local_size}). Received {len(local)}: {[d.spec for d in local]}"
        )
    # Every rank's device is known only to its own machine: backend.join gathers them.
    return Runtime(found.rank, found.world_size, [mine] * found.world_size, found, timeout)


def _bind(runtime: Runtime) -> None:

    device = runtime.device
    if not device.is_cuda and device.cores:
        try:
            os.sched_setaffinity(0, device.cores)
        except (AttributeError, OSError):  # pragma: no cover - non-Linux
            pass
    if device.memory is None:  # a device given a memory size keeps glibc's own return of freed memory
        keep_freed_memory()
    if not device.is_cuda and device.speed < 1.0:
        from multigpu.throttle import CpuQuota

        CpuQuota(device.speed, len(device.cores) or 1).apply()
    backend.get().bind(device)


def _leave() -> None:
    """Leaves the run at exit: with the others when all went well (a barrier), at once after a failure."""

    backend.get().leave(failed=failed())
