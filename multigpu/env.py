"""Every environment variable multigpu reads or sets, in one place.

They exist so that the processes a run starts can find each other, and so
that a launcher (``multigpu run``, ``multigpu.launch``) or the environment
can decide for a script without editing it: ``MULTIGPU_DEVICES``,
``MULTIGPU_RATIOS``, ``MULTIGPU_TIMEOUT`` and ``MULTIGPU_TRANSPORT``, when set,
win over the arguments the script passes to ``parallelize``.

* ``MULTIGPU_RANK``, ``MULTIGPU_WORLD_SIZE``: set by the supervisor on every
  process it starts (for ``python train.py`` and ``multigpu run``).
* ``MULTIGPU_MASTER_ADDR``, ``MULTIGPU_MASTER_PORT``: where the run's
  rendezvous store listens (127.0.0.1 and a free port on one machine).
* ``MULTIGPU_STORE_FD``: on rank 0 only, the listening socket (opened by the
  supervisor) that rank 0 serves the rendezvous store on.
* ``MULTIGPU_DEVICES``, ``MULTIGPU_RATIOS``: the device list and ratios of the
  run, comma-separated; ``multigpu run --devices/--ratios`` sets them and they
  win over the arguments the script passes to ``parallelize``.
* ``MULTIGPU_SUPERVISOR_PID``: pid of the process that started the ranks.
* ``MULTIGPU_RUN_DIR``: a folder of the run where a failing rank writes why it
  failed, for the supervisor's message.
* ``MULTIGPU_LAUNCH_DIR``: set by ``multigpu.launch`` on its ranks: the folder
  that holds the pickled function, where rank 0 leaves its return value and a
  failing rank its traceback.
* ``MULTIGPU_TIMEOUT``: seconds a collective may wait before the run fails.
* ``MULTIGPU_TRANSPORT``: ``auto``, ``shm`` or ``gloo``: how CPU ranks on one machine
  sum gradients (default ``auto``: ``shm`` on x86-64 Linux; see ``parallelize(transport=)``).
* ``MULTIGPU_PROFILE``: the profile file of measured speeds (default
  ``$XDG_CACHE_HOME/multigpu/profiles.json`` or ``~/.cache/multigpu/profiles.json``).
* ``MULTIGPU_REPLAY``: ``0`` runs Keras's own forward pass at every training step on
  torch instead of replaying its recorded operations (``multigpu.backend.torch.replay``;
  the same numbers either way, so it is for measuring what the replay buys).
* ``MULTIGPU_OVERLAP``: ``1`` sums gradients in buckets during the backward pass, ``0`` after it, on
  torch (default: during it between machines and on GPUs, after it for CPU ranks of one machine).
* ``MULTIGPU_BUCKET_MB``: the size of a bucket of overlapped gradient sums, in MiB (default 4; the
  first bucket is 1 MiB).
* ``GLOO_SOCKET_IFNAME``: set to ``lo`` on single-machine runs when unset, so
  gloo listens on the loopback interface only.
* ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``: read (never set) to join a group started
  by ``torchrun``.
* ``OMP_NUM_THREADS``: set on the processes we start, to their core count.
* ``KERAS_TORCH_DEVICE``: set on every rank multigpu starts: ``cuda:N`` for a
  GPU rank, ``cpu`` for a CPU rank (Keras's torch backend would otherwise put
  a CPU rank's tensors on a GPU where there is one).
* ``KERAS_BACKEND``: ``torch`` (the default multigpu sets where unset) or ``jax``; the supervisor
  passes it on, and on ``jax`` a rank joins the run before the program runs.
"""

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

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RUN_VARS = (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, DEVICES, RATIOS, SUPERVISOR_PID, RUN_DIR, TIMEOUT,
            LAUNCH_DIR)


def keras_backend() -> str:
    """The Keras backend in use: Keras's own once it is imported, else ``KERAS_BACKEND``, else ``torch``."""
    import sys

    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend()
    import os

    return os.environ.get("KERAS_BACKEND") or "torch"
