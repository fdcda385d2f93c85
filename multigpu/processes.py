"""Processes of a run: starting them, tying them to their parent, the store.

:class:`RankGroup` starts a command once per device with the rank variables
of :mod:`multigpu.env` set and hosts the rendezvous store on 127.0.0.1 (used
by ``multigpu run`` and ``multigpu bench``); every process started dies with
its parent.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence

from multigpu import env
from multigpu.devices import Device

__all__ = ["RankGroup", "die_with_parent", "loopback_listener", "rank_environment", "stop_processes"]


def die_with_parent() -> None:
    """Asks Linux to send SIGTERM to this process when its parent exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        pass


def loopback_listener() -> socket.socket:
    """A socket listening on 127.0.0.1 on a free port (for the store)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def rank_environment(
    rank_: int, devices: Sequence[Device], ratios: Sequence[float] | str | None, port: int, timeout: float
) -> dict[str, str]:
    """The environment variables that tell a started process who it is."""
    dev = devices[rank_]
    variables = {
        env.RANK: str(rank_),
        env.WORLD_SIZE: str(len(devices)),
        env.MASTER_ADDR: "127.0.0.1",
        env.MASTER_PORT: str(port),
        env.DEVICES: ",".join(d.spec for d in devices),
        env.LAUNCHER_PID: str(os.getpid()),
        env.TIMEOUT: f"{timeout:g}",
        "KERAS_BACKEND": "torch",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    if ratios is not None:  # only ratios given on the command line travel
        variables[env.RATIOS] = ratios if isinstance(ratios, str) else ",".join(f"{r:g}" for r in ratios)
    if not dev.is_cuda:
        variables["OMP_NUM_THREADS"] = str(max(1, len(dev.cores)))
    return variables


def stop_processes(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every process still running, SIGKILL to those alive after ``grace`` s."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class RankGroup:
    """Starts ``command`` once per device with rank variables, hosting the store.

    Used by ``multigpu run`` and ``multigpu bench``.

    Args:
        command: the command line every rank runs.
        devices: one device per rank (cores assigned).
        ratios: ratios given on the command line, or None/"auto".
        timeout: seconds a collective may wait.
        env_extra: more environment variables for every rank.
    """

    def __init__(self, command: list[str], devices: Sequence[Device], ratios, timeout: float,
                 env_extra: dict[str, str] | None = None, stdout=None) -> None:
        import torch.distributed as dist

        self.listener = loopback_listener()
        port = self.listener.getsockname()[1]
        self.store = dist.TCPStore(
            "127.0.0.1", port, len(devices), True, datetime.timedelta(seconds=timeout),
            wait_for_workers=False, master_listen_fd=self.listener.fileno(),
        )
        self.listener.detach()  # the store owns the socket now
        self.devices = list(devices)
        self.procs: list[subprocess.Popen] = []
        for r in range(len(devices)):
            child_env = dict(os.environ)
            child_env.update(rank_environment(r, devices, ratios, port, timeout))
            child_env.update(env_extra or {})
            self.procs.append(subprocess.Popen(
                command, env=child_env, preexec_fn=die_with_parent, stdout=stdout,
            ))

    def wait(self) -> tuple[int, int | None]:
        """Waits until all succeed or one fails; returns (code, failed rank)."""
        while True:
            failure = self.failure()
            if failure is not None:
                return failure
            if all(p.poll() == 0 for p in self.procs):
                return 0, None
            time.sleep(0.1)

    def failure(self) -> tuple[int, int] | None:
        """(code, rank) of a failed rank, or None while none has failed.

        A rank killed by a signal is named first: ranks that exited with an
        error in the same interval most likely lost a peer.
        """
        failed = [(r, code) for r, code in enumerate(p.poll() for p in self.procs) if code not in (None, 0)]
        if not failed:
            return None
        r, code = min(failed, key=lambda rc: (rc[1] > 0, rc[0]))
        return code, r

    def stop(self, grace: float = 5.0) -> None:
        """Terminates the ranks still running (SIGTERM, then SIGKILL)."""
        stop_processes(self.procs, grace)
        self.store = None  # shuts the store's server down

    def describe_failure(self, code: int, rank_: int) -> str:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"rank {rank_} ({self.devices[rank_].label}) {how}"
