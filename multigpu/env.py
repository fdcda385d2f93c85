"""Every environment variable multigpu reads or sets, in one place.

Explicit arguments win over these; they exist so that the processes a run
starts can find each other.

* ``MULTIGPU_RANK``, ``MULTIGPU_WORLD_SIZE``: set by the launcher on every
  process it starts (by :func:`multigpu.parallelize` or ``multigpu run``).
* ``MULTIGPU_MASTER_ADDR``, ``MULTIGPU_MASTER_PORT``: where rank 0's store
  listens (127.0.0.1 and a free port on one machine).
* ``MULTIGPU_DEVICES``, ``MULTIGPU_RATIOS``: the device list and ratios of the
  run, comma-separated; ``multigpu run --devices/--ratios`` sets them and they
  win over the arguments the script passes to ``parallelize``.
* ``MULTIGPU_LAUNCHER_PID``: pid of the process that started the ranks.
* ``MULTIGPU_TIMEOUT``: seconds a collective may wait before the run fails.
* ``MULTIGPU_PROFILE``: the profile file of measured speeds (default
  ``$XDG_CACHE_HOME/multigpu/profiles.json`` or ``~/.cache/multigpu/profiles.json``).
* ``GLOO_SOCKET_IFNAME``: set to ``lo`` on single-machine runs when unset, so
  gloo listens on the loopback interface only.
* ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``: read (never set) to join a group started
  by ``torchrun``.
* ``OMP_NUM_THREADS``: set on the processes we start, to their core count.
* ``KERAS_BACKEND``: must be ``torch``; ``multigpu run`` sets it when unset.
"""

RANK = "MULTIGPU_RANK"
WORLD_SIZE = "MULTIGPU_WORLD_SIZE"
MASTER_ADDR = "MULTIGPU_MASTER_ADDR"
MASTER_PORT = "MULTIGPU_MASTER_PORT"
DEVICES = "MULTIGPU_DEVICES"
RATIOS = "MULTIGPU_RATIOS"
LAUNCHER_PID = "MULTIGPU_LAUNCHER_PID"
TIMEOUT = "MULTIGPU_TIMEOUT"

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
