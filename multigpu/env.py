"""Every environment variable multigpu reads or sets, in one place, and the only reads of them.

Nothing else in the package reads ``os.environ`` (``tests/test_launchers.py``
checks it): modules call :func:`get`, :func:`copy`, :func:`set_default` and
:func:`pop` here, and the launchers' own variables (torchrun's, SLURM's,
MPI's) are read by :mod:`multigpu.runtime.environments`.

Variables are wiring between multigpu's own processes, or stand in for an
argument of ``parallelize``.  One rule decides between them (:func:`fallback`):
what is given for this run wins over the script, and the script over the
environment.  A value given on ``multigpu run``'s command line or to
``multigpu.launch`` (both name it in ``MULTIGPU_GIVEN``) wins over the
script's argument; an argument given to ``parallelize`` wins over a variable
the user set; a variable counts where the argument is left unset.  Where two
that were both given differ, rank 0 says in one line which it took.

* ``MULTIGPU_RANK``, ``MULTIGPU_WORLD_SIZE``: set by the supervisor on every
  process it starts (for ``python train.py`` and ``multigpu run``).
* ``MULTIGPU_MASTER_ADDR``, ``MULTIGPU_MASTER_PORT``: where the run's
  rendezvous store listens (127.0.0.1 and a free port on one machine).
* ``MULTIGPU_STORE_FD``: on rank 0 only, the listening socket (opened by the
  supervisor) that rank 0 serves the rendezvous store on.
* ``MULTIGPU_DEVICES``: the device list of a run multigpu's supervisor started
  (every rank's, comma-separated): the processes are on those devices, so a
  script's ``devices=`` that lists others is told so, in one line.
* ``MULTIGPU_RATIOS``: ``parallelize``'s ``ratios`` (``multigpu run --ratios``).
* ``MULTIGPU_SUPERVISOR_PID``: pid of the process that started the ranks.
* ``MULTIGPU_RUN_DIR``: a folder of the run where a failing rank writes why it
  failed, for the supervisor's message.
* ``MULTIGPU_LAUNCH_DIR``: set by ``multigpu.launch`` on its ranks: the folder
  that holds the pickled function, where rank 0 leaves its return value and a
  failing rank its traceback.
* ``MULTIGPU_TIMEOUT``: seconds a collective may wait: ``parallelize``'s
  ``timeout`` (``multigpu run --timeout``).
* ``MULTIGPU_TRANSPORT``: ``auto``, ``shm`` or ``gloo``: ``parallelize``'s ``transport``.
* ``MULTIGPU_PROFILE``: the profile file of measured speeds (default
  ``$XDG_CACHE_HOME/multigpu/profiles.json`` or ``~/.cache/multigpu/profiles.json``).
* ``MULTIGPU_REPLAY``, ``MULTIGPU_OVERLAP``, ``MULTIGPU_BUCKET_MB``: ``parallelize``'s ``replay``
  (``0``/``1``), ``overlap`` (``0``/``1``) and ``bucket_mb`` (MiB) (on
  torch; read by ``parallelize`` and handed to the step as values).
* ``MULTIGPU_MIN_DEVICES``: ``parallelize``'s ``min_devices`` (``multigpu run --min-devices``).
* ``MULTIGPU_REJOIN``: ``1`` on a lost rank's process that the supervisor
  started again (``--max-restarts``): it joins the run at a step of ``fit``
  instead of at the start.
* ``MULTIGPU_SHARED_ARRAYS``: the descriptors of the shared files that
  :func:`multigpu.load_once` filled in a script's first process, in call
  order (a JSON list), passed on to the ranks it starts.
* ``MULTIGPU_GIVEN``: the variables above that ``multigpu run``'s command line
  or ``multigpu.launch`` set (comma-separated names): they win over the
  script's arguments.
* ``MULTIGPU_LOG_LEVEL``: the level of multigpu's messages (``debug``, ``info``, ``warning``, ``error``;
  default ``info``) in every process of a run (``multigpu run --log-level``); :mod:`multigpu.log`.
* ``MULTIGPU_FAULT``: a testing aid that kills named ranks at named points
  (:mod:`multigpu.membership`); never set it in a real run.
* ``MULTIGPU_PARK``: a testing aid: ``force`` sets the devices but the
  leader aside after each fit's first epoch (``force:R``: all but rank
  ``R``), ``off`` never sets one aside
  (:mod:`multigpu.balancing.parking`); never set it in a real run.
* ``GLOO_SOCKET_IFNAME``: set to ``lo`` on single-machine runs when unset, so
  gloo listens on the loopback interface only.
* Launchers' variables, read by :mod:`multigpu.runtime.environments` only:
  torchrun's (and Kubernetes' PyTorchJob's) ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
  SLURM's ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NUM_TASKS``,
  ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NODELIST``,
  ``SLURM_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE``,
  ``SLURM_JOB_ID``, ``SLURM_STEP_ID``; Open MPI's ``OMPI_COMM_WORLD_RANK``,
  ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
  ``OMPI_COMM_WORLD_LOCAL_SIZE``, ``OMPI_MCA_ess_base_jobid``,
  ``PMIX_NAMESPACE``; PMI's ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
  ``MPI_LOCALNRANKS``, ``PMI_LOCAL_RANK``, ``PMI_LOCAL_SIZE``,
  ``PMI_KVSNAME``, ``PMI_JOBID``; and ``JAX_COORDINATOR_ADDRESS`` (where JAX's
  coordinator listens under an outside launcher; default: ``MASTER_PORT + 1``
  on the rendezvous host).  Never set.
* ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``: glibc's own settings of its
  malloc; where one is set, a rank leaves its malloc thresholds as they are
  (:func:`multigpu.runtime.processes.keep_freed_memory`).  Never set.
* ``CUDA_VISIBLE_DEVICES``: read to number the GPUs a launcher gave the process.
* ``XDG_CACHE_HOME``: where the profile file goes by default.
* ``OMP_NUM_THREADS``: set on the processes we start, to their core count.
* ``KERAS_TORCH_DEVICE``: set on every rank multigpu starts: ``cuda:N`` for a
  GPU rank, ``cpu`` for a CPU rank (Keras's torch backend would otherwise put
  a CPU rank's tensors on a GPU where there is one).
* ``KERAS_BACKEND``: ``torch`` (the default multigpu sets where unset), ``jax`` or ``tensorflow``; the
  supervisor passes it on, and on JAX and TensorFlow a rank joins the run before the program runs.
* ``TF_CPP_MIN_LOG_LEVEL``: ``1`` on every rank multigpu starts where unset: TensorFlow's INFO lines (its
  CPU-feature line) are not printed once per rank, nor are the INFO lines it writes while it is imported, before
  its log starts (its oneDNN line: :mod:`multigpu.runtime.rank_entry` leaves them out).
"""

from __future__ import annotations

import os
from collections.abc import Callable

RANK = "MULTIGPU_RANK"
WORLD_SIZE = "MULTIGPU_WORLD_SIZE"
MASTER_ADDR = "MULTIGPU_MASTER_ADDR"
MASTER_PORT = "MULTIGPU_MASTER_PORT"
STORE_FD = "MULTIGPU_STORE_FD"
DEVICES = "MULTIGPU_DEVICES"
RATIOS = "MULTIGPU_RATIOS"
SUPERVISOR_PID = "MULTIGPU_SUPERVISOR_PID"
RUN_DIR = "MULTIGPU_RUN_DIR"
LAUNCH_DIR = "MULTIGPU_LAUNCH_DIR"
TIMEOUT = "MULTIGPU_TIMEOUT"
TRANSPORT = "MULTIGPU_TRANSPORT"
PROFILE = "MULTIGPU_PROFILE"
REPLAY = "MULTIGPU_REPLAY"
OVERLAP = "MULTIGPU_OVERLAP"
BUCKET_MB = "MULTIGPU_BUCKET_MB"
MIN_DEVICES = "MULTIGPU_MIN_DEVICES"
FAULT = "MULTIGPU_FAULT"
PARK = "MULTIGPU_PARK"
REJOIN = "MULTIGPU_REJOIN"
SHARED_ARRAYS = "MULTIGPU_SHARED_ARRAYS"
LOG_LEVEL = "MULTIGPU_LOG_LEVEL"
GIVEN = "MULTIGPU_GIVEN"
MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RUN_VARS = (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, DEVICES, RATIOS, SUPERVISOR_PID, RUN_DIR, TIMEOUT,
            LAUNCH_DIR, GIVEN)
# How the run names a variable that was given for it, in the one line that says it won.
_GIVEN_AS = {DEVICES: "--devices", RATIOS: "--ratios", TIMEOUT: "--timeout", MIN_DEVICES: "--min-devices"}


def get(name: str, default: str | None = None) -> str | None:
    """The variable ``name``, or ``default`` when it is unset."""
    return os.environ.get(name, default)


def copy() -> dict[str, str]:
    """This process's environment, to start another process with."""
    return dict(os.environ)


def set_default(name: str, value: str) -> str:
    """Sets ``name`` to ``value`` where it is unset; returns what it holds."""
    return os.environ.setdefault(name, value)


def put(name: str, value: str) -> None:
    """Sets ``name`` for this process and the processes it starts."""
    os.environ[name] = value


def pop(name: str) -> str | None:
    """Removes ``name`` (a value meant for this process alone, such as an inherited socket); returns it."""
    return os.environ.pop(name, None)


def given(*names: str) -> None:
    """Marks the variables ``names`` as given for this run (``multigpu run``'s command line, ``multigpu.launch``):
    they win over the script's arguments in this process and the processes it starts."""
    marked = [n for n in (get(GIVEN) or "").split(",") if n]
    put(GIVEN, ",".join(dict.fromkeys([*marked, *names])))


def fallback(argument: str, value, variable: str, parse: Callable[[str], object] = str,
             say: Callable[[str], None] | None = None, same: Callable[[object, object], bool] | None = None):
    """What the run takes for ``argument`` of ``parallelize``, by the one rule of this module's docstring.

    A variable given for the run (named in ``MULTIGPU_GIVEN``) wins over
    ``value``; otherwise ``value`` wins over the variable; the variable counts
    where ``value`` is None.

    Args:
        argument: the argument's name, for the message.
        value: what the script passed (None: left unset).
        variable: the variable that stands in for it.
        parse: turns the variable's text into a value of the argument's kind.
        say: where the one line goes when both are set and differ (rank 0's log).
        same: whether the argument and the parsed variable say the same (default ``==``).

    Returns:
        The value taken, or None where neither is set.
    """
    text = os.environ.get(variable)
    if value is None:
        return None if not text else parse(text)
    if not text:
        return value
    theirs = parse(text)
    if (same or (lambda a, b: a == b))(value, theirs):
        return value
    if variable in (get(GIVEN) or "").split(","):
        if say is not None:
            flag = _GIVEN_AS.get(variable, variable)
            say(f"{flag} {text} (given to multigpu run or multigpu.launch) wins over {argument}={value!r} given to "
                "parallelize")
        return theirs
    if say is not None:
        say(f"{argument}={value!r} given to parallelize wins over {variable}={text}")
    return value


def keras_backend() -> str:
    """The Keras backend in use: Keras's own once it is imported, else ``KERAS_BACKEND``, else ``torch``."""
    import sys

    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend()
    return os.environ.get("KERAS_BACKEND") or "torch"
