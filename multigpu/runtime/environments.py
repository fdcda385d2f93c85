"""Who started this process, and what that launcher says of its place in the run.

One class per launcher, each with ``detect(environ)`` and ``read(environ)``
(as Lightning Fabric's cluster environments have), tried in order by
:func:`detect`:

* :class:`Supervised`: a rank that multigpu's own supervisor started (a plain
  ``python train.py`` that re-ran itself, ``multigpu run``, ``multigpu.launch``);
  it knows every rank's device and serves the rendezvous store on the socket
  the supervisor opened;
* :class:`TorchRun`: ``torchrun`` (torch elastic), or any launcher that sets
  torch's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
  (Kubernetes' PyTorchJob sets them in every pod, without a local rank: one
  process per pod);
* :class:`Slurm`: a task of ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, ``SLURM_NODELIST``); the rendezvous is on the first node
  of the step;
* :class:`Mpi`: a process of ``mpirun`` (Open MPI's ``OMPI_COMM_WORLD_*``, or
  PMI's ``PMI_RANK``/``PMI_SIZE`` under MPICH and Intel MPI); the rendezvous
  is on this machine when every rank is here, else on ``MASTER_ADDR``.

None of them: the process is alone, and :func:`multigpu.runtime.start`
supervises a run of its own when it is given several devices.  An
environment is read once, when the run starts; nothing below
:mod:`multigpu.runtime` reads these variables.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from multigpu import env

__all__ = ["Environment", "Mpi", "Slurm", "Supervised", "TorchRun", "detect", "first_host"]


@dataclass(frozen=True)
class Environment:
    """This process's place in a run, as its launcher gave it.

    Attributes:
        rank: this process's rank.
        world_size: the number of processes.
        local_rank: its rank among the processes of this machine.
        local_size: the number of processes on this machine.
        master_addr: the host of the rendezvous store (rank 0's machine).
        master_port: the store's port.
        coordinator_address: where JAX's coordinator listens, when the environment says
            (``JAX_COORDINATOR_ADDRESS``).
    """

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    master_addr: str
    master_port: int
    coordinator_address: str | None = None

    #: The launcher's name, for messages ("torchrun", "SLURM", ...).
    name = "launcher"
    #: The launcher in a sentence, and the variables multigpu reads from it, for messages.
    title = "a launcher"
    needs = ""
    #: Whether the launcher lists every rank's device (multigpu's supervisor); the others' ranks gather them.
    knows_every_device = False

    @property
    def same_host(self) -> bool:
        """True when every rank runs on this machine."""
        return self.local_size == self.world_size

    @property
    def host_leader(self) -> int:
        """The global rank of this machine's local rank 0 (every launcher here numbers a machine's ranks in a
        row: torchrun always, ``srun`` and ``mpirun`` with their default block distribution)."""
        return self.rank - self.local_rank

    @property
    def coordinator(self) -> str:
        """Where JAX's coordinator listens: ``JAX_COORDINATOR_ADDRESS``, else the port after the rendezvous's."""
        return self.coordinator_address or f"{self.master_addr}:{self.master_port + 1}"

    def describe(self) -> str:
        return f"{self.name}: rank {self.rank} of {self.world_size}, local rank {self.local_rank} of {self.local_size}"


class _UnsetError(ValueError):
    """A variable the launcher found should have set (named in :func:`detect`'s message)."""


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None or text == "":
        if default is None:
            raise _UnsetError(name)
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"multigpu: {name} must be an integer. Received: {name}={text!r}") from None


def _port(environ: Mapping[str, str], seed: str) -> int:
    """``MASTER_PORT`` when set, else a port derived from the job's identity (the same on every rank)."""
    if environ.get("MASTER_PORT"):
        return _int(environ, "MASTER_PORT")
    return 20000 + zlib.crc32(seed.encode()) % 20000


@dataclass(frozen=True)
class Supervised(Environment):
    """A rank started by multigpu's supervisor (``MULTIGPU_RANK``)."""

    name = "multigpu"
    title = "multigpu's supervisor"
    needs = (f"{env.RANK} and {env.WORLD_SIZE}, which it sets for the ranks it starts; a {env.RANK} exported in "
             "your shell or left by another run makes a plain process look like one of its ranks: unset it")
    knows_every_device = True

    @property
    def coordinator(self) -> str:
        """The supervisor's port itself: rank 0 closes the store's socket before JAX's coordinator takes it."""
        return f"{self.master_addr}:{self.master_port}"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return environ.get(env.RANK) is not None

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> Supervised:
        size = _int(environ, env.WORLD_SIZE)
        return cls(_int(environ, env.RANK), size, _int(environ, env.RANK), size,
                   environ.get(env.MASTER_ADDR) or "127.0.0.1", _int(environ, env.MASTER_PORT, 0))


@dataclass(frozen=True)
class TorchRun(Environment):
    """torchrun, or a launcher that sets torch's variables (Kubernetes' PyTorchJob: no local rank, one process
    per pod)."""

    name = title = "torchrun"
    needs = ("RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (and LOCAL_RANK, LOCAL_WORLD_SIZE where a machine runs "
             "several)")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return all(environ.get(v) for v in env.TORCHRUN_VARS)

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> TorchRun:
        return cls(_int(environ, "RANK"), _int(environ, "WORLD_SIZE"), _int(environ, "LOCAL_RANK", 0),
                   _int(environ, "LOCAL_WORLD_SIZE", 1), environ["MASTER_ADDR"], _int(environ, "MASTER_PORT"),
                   environ.get("JAX_COORDINATOR_ADDRESS"))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,9],gpu1`` gives ``node03``.

    Raises:
        ValueError: when the list names no host.
    """
    m = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"multigpu: cannot read the first host of SLURM_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


@dataclass(frozen=True)
class Slurm(Environment):
    """A task of ``srun`` (inside a job step: ``SLURM_STEP_ID`` is set, so a batch script's own shell is not
    taken for a rank)."""

    name = "SLURM"
    title = "SLURM's srun"
    needs = ("SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_ID and SLURM_JOB_ID (and SLURM_LOCALID, SLURM_NODELIST), which "
             "`srun` sets for each task of a job step")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return all(environ.get(v) for v in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_JOB_ID"))

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> Slurm:
        size = _int(environ, "SLURM_STEP_NUM_TASKS", 0) or _int(environ, "SLURM_NTASKS")
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST") or "127.0.0.1"
        local_size = _tasks_here(environ, size)
        seed = f"slurm-{environ['SLURM_JOB_ID']}-{environ['SLURM_STEP_ID']}"
        return cls(_int(environ, "SLURM_PROCID"), size, _int(environ, "SLURM_LOCALID", 0), local_size,
                   environ.get("MASTER_ADDR") or first_host(nodes), _port(environ, seed),
                   environ.get("JAX_COORDINATOR_ADDRESS"))


def _tasks_here(environ: Mapping[str, str], size: int) -> int:
    """Tasks of this step on this node: ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) at ``SLURM_NODEID``."""
    text = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not text:
        return size
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return size
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int(environ, "SLURM_NODEID", 0)
    return counts[node] if node < len(counts) else size


@dataclass(frozen=True)
class Mpi(Environment):
    """A process of ``mpirun``: Open MPI's variables, or PMI's (MPICH, Intel MPI)."""

    name = "MPI"
    title = "mpirun (Open MPI or PMI)"
    needs = ("Open MPI's OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (and OMPI_COMM_WORLD_LOCAL_RANK, "
             "OMPI_COMM_WORLD_LOCAL_SIZE), which its `mpirun` sets, or PMI's PMI_RANK and PMI_SIZE (MPICH, Intel MPI)")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return bool(environ.get("OMPI_COMM_WORLD_RANK") or (environ.get("PMI_RANK") and environ.get("PMI_SIZE")))

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> Mpi:
        if environ.get("OMPI_COMM_WORLD_RANK"):
            rank, size = _int(environ, "OMPI_COMM_WORLD_RANK"), _int(environ, "OMPI_COMM_WORLD_SIZE")
            local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
            local_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", size)
            job = environ.get("OMPI_MCA_ess_base_jobid") or environ.get("PMIX_NAMESPACE") or "mpi"
        else:
            rank, size = _int(environ, "PMI_RANK"), _int(environ, "PMI_SIZE")
            local_rank = _int(environ, "MPI_LOCALRANKID", _int(environ, "PMI_LOCAL_RANK", rank))
            local_size = _int(environ, "MPI_LOCALNRANKS", _int(environ, "PMI_LOCAL_SIZE", size))
            job = environ.get("PMI_KVSNAME") or environ.get("PMI_JOBID") or "mpi"
        addr = environ.get("MASTER_ADDR")
        if not addr:
            if local_size != size and size > 1:
                raise ValueError(
                    f"multigpu: mpirun started {size} processes over several machines and nothing says where rank 0 "
                    "runs: pass its host, e.g. `mpirun -x MASTER_ADDR=$(hostname) ...` (Open MPI) or "
                    "`-genv MASTER_ADDR ...` (MPICH)")
            addr = "127.0.0.1"
        return cls(rank, size, local_rank, local_size, addr, _port(environ, f"mpi-{job}"),
                   environ.get("JAX_COORDINATOR_ADDRESS"))


LAUNCHERS: tuple[type[Environment], ...] = (Supervised, TorchRun, Slurm, Mpi)


def detect(environ: Mapping[str, str]) -> Environment | None:
    """The launcher that started this process, or None for a process alone.

    A launcher that started one process (``srun -n 1``, ``mpirun -np 1``) is
    a process alone, too: it may still supervise a run of its own.
    """
    for launcher in LAUNCHERS:
        if launcher.detect(environ):
            try:
                found = launcher.read(environ)
            except _UnsetError as exc:
                raise ValueError(
                    f"multigpu: this process looks started by {launcher.title}, but {exc} is not set. From it, "
                    f"multigpu reads {launcher.needs}. Start the script through the launcher itself, or unset the "
                    "variables that make it look so") from None
            if found.world_size > 1 or launcher is Supervised:
                return found
            return None
    return None
