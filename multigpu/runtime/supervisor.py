"""The one process supervisor: starts a rank per device, watches them, ends the run.

Used by a plain ``python train.py`` (the first ``parallelize`` call turns the
user's process into the supervisor and runs the script again once per
device), by ``multigpu run`` and by the benchmark workers.  The supervisor
does not train; it

* opens the run's rendezvous socket on 127.0.0.1 and a free port (rank 0
  serves it; no other process can take the port in between), and a folder
  where a failing rank writes why it fails;
* starts every rank through :mod:`multigpu.runtime.rank_entry`, tied to the
  supervisor (each dies with it);
* when a rank fails (an exit code, a signal, or a written reason while it is
  still alive, stuck in C++ code say), gives the others a moment to end on
  their own, then stops them, and names the rank, its device and the reason;
* on SIGINT/SIGTERM stops every rank;
* restarts all ranks after a failure, ``max_restarts`` times;
* where the ranks allow it (``parallelize(min_devices=)``), goes on without a
  rank that died by a signal or stopped beating (:mod:`multigpu.membership`):
  it ends that process and writes the new record of members, and the others
  go on; with restarts left it starts that rank's process again, and writes
  it back into the record once it says it is ready: the others take it in
  at their next step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from multigpu import env, membership
from multigpu.devices import Device
from multigpu.failure import read_failure
from multigpu.log import logger as log
from multigpu.runtime.processes import (
    die_with_parent,
    loopback_listener,
    rank_environment,
    run_folder,
    stop_processes,
)

__all__ = ["Supervisor", "become_supervisor"]

POLL = 0.05
GRACE = 2.0  # seconds the other ranks get to end on their own after a failure


def _describe_code(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    """Starts ``command`` once per device with the rank variables set.

    Args:
        command: the command line of every rank (usually ``python -m
            multigpu.runtime.rank_entry ...``).
        devices: one device per rank, cores assigned.
        timeout: seconds a collective may wait, for ranks whose script passes none (None: 60).
        ratios: ratios given on the command line, passed on to the ranks.
        env_extra: more environment variables for every rank.
        stdout: the ranks' standard output (default: inherited).
        stderr: the ranks' standard error (default: inherited; ``subprocess.STDOUT`` merges it).
        cores: CPU cores the ranks may use (default: this process's); each rank then takes its
            share of them.
        shared_fds: the files of :func:`multigpu.load_once` this process holds for the ranks (every rank
            inherits them; without them, the ranks load their own).
    """

    def __init__(self, command: list[str], devices: Sequence, timeout: float | None, *, ratios: str | None = None,
                 env_extra: dict[str, str] | None = None, stdout=None, stderr=None,
                 cores: Sequence[int] | None = None, shared_fds: Sequence[int] = ()) -> None:
        self.command = list(command)
        self.devices = list(devices)
        self.timeout = None if timeout is None else float(timeout)
        self.ratios = ratios
        self.env_extra = dict(env_extra or {})
        self.stdout, self.stderr = stdout, stderr
        self.cores = list(cores) if cores else None
        self.shared_fds = tuple(shared_fds)
        self.procs: list[subprocess.Popen] = []
        self.run_dir: str | None = None
        self.port: int | None = None
        self._reported_at: dict[int, float] = {}
        self.lost: dict[int, str] = {}  # rank -> why it was lost
        self.joining: dict[int, float] = {}  # rank -> when its process was started again, until it is a member
        self.admitted: dict[int, int] = {}  # rank -> the generation that counts it again, until the others form it
        self.restarts_left = 0

    # ------------------------------------------------------------ one attempt
    def start(self) -> None:
        """Starts every rank."""
        env.set_default("GLOO_SOCKET_IFNAME", "lo")
        self.run_dir = run_folder("run")
        listener = loopback_listener()
        self.port = listener.getsockname()[1]
        self.procs = []
        self._reported_at = {}
        self.lost = {}
        self.joining = {}
        self.admitted = {}
        try:
            for r in range(len(self.devices)):
                self.procs.append(self._spawn(r, listener if r == 0 else None))
        finally:
            listener.close()

    def _spawn(self, rank: int, listener=None, rejoin: bool = False) -> subprocess.Popen:
        """Starts ``rank``'s process (rank 0 of a first start serves the rendezvous on ``listener``; a process
        started again after a loss joins the others at a step of ``fit``, without the testing aid's faults)."""
        child_env = env.copy()
        child_env.update(rank_environment(rank, self.devices, self.port, self.timeout, self.run_dir, self.ratios))
        child_env.update(self.env_extra)
        child_env.pop(env.SHARED_ARRAYS, None)
        fds: tuple[int, ...] = self.shared_fds
        if fds:
            child_env[env.SHARED_ARRAYS] = json.dumps(list(fds))
        if listener is not None:
            child_env[env.STORE_FD] = str(listener.fileno())
            fds = (*fds, listener.fileno())
        if rejoin:
            child_env[env.REJOIN] = "1"
            child_env.pop(env.FAULT, None)
        return subprocess.Popen(self.command, env=child_env, preexec_fn=self._prepare, stdout=self.stdout,
                                stderr=self.stderr, pass_fds=fds)

    def _prepare(self) -> None:
        """In each rank's process before it runs: its cores, and its tie to this process."""
        if self.cores:
            os.sched_setaffinity(0, self.cores)
        die_with_parent()

    def failure(self) -> tuple[int, int] | None:
        """``(code, rank)`` of the rank that caused a failure, or None while none has failed.

        A rank killed by a signal is named first, then the first that said
        why it failed (the others most likely lost it), then the lowest rank.
        """
        now = time.time()
        failed = []
        for r, p in enumerate(self.procs):
            if r in self.lost:
                continue
            code = p.poll()
            said = self._said_at(r)
            if code not in (None, 0):
                failed.append((0 if code < 0 else 1, said, r, code))
            elif code is None and said < now - GRACE:
                failed.append((1, said, r, 1))  # said it failed, but did not end: stuck
        if not failed:
            return None
        _, _, r, code = min(failed)
        return code, r

    def _said_at(self, rank: int) -> float:
        """When ``rank`` wrote why it failed (infinity when it did not)."""
        if rank in self._reported_at:
            return self._reported_at[rank]
        if self.run_dir:
            try:
                self._reported_at[rank] = os.stat(os.path.join(self.run_dir, f"rank{rank}.failure")).st_mtime
                return self._reported_at[rank]
            except OSError:
                pass
        return float("inf")

    def wait(self) -> tuple[int, int | None]:
        """Waits until every rank succeeded or one failed; returns ``(code, failed rank or None)``.

        A rank lost while the others may go on without it (see :meth:`_lose`) is not a failure.
        """
        while True:
            code, rank = self.poll()
            if code is not None:
                return code, rank
            time.sleep(POLL)

    def poll(self) -> tuple[int | None, int | None]:
        """``(None, None)`` while the run goes on, ``(0, None)`` once every rank succeeded, ``(code, rank)``
        when one failed (a lost rank the others go on without is not a failure: see :meth:`_lose`)."""
        failure = self.failure() or self._hung()
        if failure is not None and not self._lose(*failure):
            return failure
        self._admit()
        for r, generation in list(self.admitted.items()):
            if membership.welcomed(self.run_dir, generation):
                self.admitted.pop(r)  # in the others' group: a member like any other
        outside = set(self.joining) | set(self.admitted)  # started again, in no group yet
        members = [p for r, p in enumerate(self.procs) if r not in self.lost and r not in outside]
        if all(p.poll() == 0 for p in members):
            for r in sorted(outside):  # came back too late: the run ended before it could take part
                self.procs[r].kill()
                self.procs[r].wait()
                self.joining.pop(r, None)
                self.admitted.pop(r, None)
                self.lost[r] = "started again, but the run ended before it could rejoin"
            return 0, None
        return None, None

    def _hung(self) -> tuple[int, int] | None:
        """``(-SIGSTOP, rank)`` for a rank that stopped beating in a run that may shrink."""
        if not self.run_dir or not membership.shrink_allowed(self.run_dir, range(len(self.procs))):
            return None
        now = time.time()
        for r, p in enumerate(self.procs):
            age = membership.beat_age(self.run_dir, r, now)
            if r not in self.lost and p.poll() is None and age is not None and age > membership.LOST_AFTER:
                return -signal.SIGSTOP, r
        return None

    def _lose(self, code: int, rank: int) -> bool:
        """Goes on without ``rank`` if it died by a signal or hung and the ranks left may go on; returns whether.

        The process is ended (a stopped one killed) before the new record of members is written, so that it
        can no longer touch what the others share.
        """
        left = [r for r in self._members() if r != rank]
        floor = membership.shrink_allowed(self.run_dir, left) if self.run_dir else None
        if code >= 0 or floor is None or read_failure(self.run_dir, rank):
            return False
        proc = self.procs[rank]
        why = ("stopped answering (no heartbeat for "
               f"{membership.LOST_AFTER:g} s)" if code == -signal.SIGSTOP else _describe_code(code))
        label = self.devices[rank].label
        if len(left) < floor:
            log.error(f"rank {rank} ({label}) {why}; {len(left)} device(s) left "
                      f"({', '.join(self.devices[r].label for r in left)}), fewer than min_devices={floor}: "
                      "ending the run.")
            return False
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self.lost[rank] = why
        if self.joining.pop(rank, None) is None:  # a member (one still coming back is in no group yet)
            old = membership.read(self.run_dir)
            entry = {"rank": rank, "device": label, "why": why, "at": time.time()}
            membership.write(self.run_dir, membership.Members(
                (old.generation if old else 0) + 1, tuple(left), (*(old.lost if old else ()), entry),
                old.joined if old else ()))
        log.warning(f"rank {rank} ({label}) {why}; going on with {len(left)} device(s): "
                    f"{', '.join(self.devices[r].label for r in left)}.")
        if self.restarts_left > 0:
            self.restarts_left -= 1
            membership.forget_rank(self.run_dir, rank)
            self._reported_at.pop(rank, None)
            self.procs[rank] = self._spawn(rank, rejoin=True)
            self.lost.pop(rank)  # watched again: a failure of the new process is one
            self.joining[rank] = time.time()
            log.warning(f"starting rank {rank} ({label}) again; it rejoins at a step of fit "
                        f"({self.restarts_left} restart(s) left).")
        return True

    def _members(self) -> list[int]:
        """The ranks in the run, in the order of the record (survivors first, then ranks that came back)."""
        record = membership.read(self.run_dir)
        order = list(record.members) if record else list(range(len(self.procs)))
        return [r for r in order if r not in self.lost and r not in self.joining]

    def _admit(self) -> None:
        """Counts a restarted rank that reached its ``fit`` among the members again (a new record)."""
        for rank in [r for r in self.joining if membership.is_ready(self.run_dir, r)]:
            started = self.joining.pop(rank)
            old = membership.read(self.run_dir)
            label = self.devices[rank].label
            members = (*self._members(), rank)
            entry = {"rank": rank, "device": label, "at": time.time()}
            generation = (old.generation if old else 0) + 1
            membership.write(self.run_dir, membership.Members(
                generation, members, old.lost if old else (), (*(old.joined if old else ()), entry)))
            self.admitted[rank] = generation
            log.info(f"rank {rank} ({label}) is ready again ({time.time() - started:.1f} s after its "
                     "start); the others take it in at their next step.")

    def describe_failure(self, code: int, rank: int) -> str:
        """``rank 1 (CPU:1) exited with code 1: <the reason the rank gave>``."""
        proc = self.procs[rank] if rank < len(self.procs) else None
        alive = proc is not None and proc.poll() is None
        how = "failed and did not end; stopped it" if alive else _describe_code(code)
        text = f"rank {rank} ({self.devices[rank].label}) {how}"
        reason = read_failure(self.run_dir, rank) if self.run_dir else None
        return f"{text}: {reason.splitlines()[0]}" if reason else text

    def stop(self, grace: float = 3.0) -> None:
        """Lets the ranks end on their own for ``GRACE`` s, then SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + GRACE
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL)
        stop_processes(self.procs, grace)
        self._cleanup()

    def _cleanup(self) -> None:
        from multigpu.throttle import remove_group_of

        for p in self.procs:
            remove_group_of(p.pid)
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None
        if self.port is not None:
            from multigpu.data.exchange import remove_run_files

            remove_run_files(str(self.port))  # input batches a failed rank left in shared memory
            self.port = None

    # ------------------------------------------------------------- the run
    def run(self, max_restarts: int = 0, prefix: str = "multigpu") -> int:
        """Runs the ranks (again after a failure, up to ``max_restarts`` times); returns the exit code.

        SIGINT and SIGTERM stop every rank; the exit code is then 128 + the signal.
        """
        def on_signal(signum, frame):
            stop_processes(self.procs, 2.0)
            self._cleanup()
            sys.stdout.flush()
            os._exit(128 + signum)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.restarts_left = max_restarts
        try:
            while True:
                self.start()
                code, failed = self.wait()
                if failed is None:
                    self._cleanup()
                    return 0
                log.error(f"{self.describe_failure(code, failed)}; stopping the other ranks.",
                          extra={"source": prefix})
                self.stop()
                if self.restarts_left <= 0:
                    return code if code > 0 else 1
                self.restarts_left -= 1
                log.warning(f"restarting all ranks ({max_restarts - self.restarts_left} of {max_restarts}).",
                            extra={"source": prefix})
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


# ------------------------------------------------------------------ a script's first process
def become_supervisor(command: list[str], devices: Sequence[Device], timeout: float | None) -> None:
    """Replaces this process (a script at its first ``parallelize``) with a small supervisor program.

    ``exec`` keeps the pid, the standard streams, the environment and the
    files of :func:`multigpu.load_once` (inheritable descriptors), and gives
    back everything else the script held: the ranks hold its arrays, the
    supervisor does not.  The new program runs :class:`Supervisor` and exits
    with the run's exit code.  Returns only where ``exec`` failed.
    """
    from multigpu.runtime.load_once import inherited_fds

    spec = {"command": list(command), "timeout": timeout, "shared_fds": list(inherited_fds()),
            "devices": [[d.kind, d.index, d.speed, list(d.cores), d.memory] for d in devices]}
    # The program imports multigpu from where this process did (a checkout on sys.path, not installed, too); the
    # ranks get the environment as it was.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environ = env.copy()
    spec["pythonpath"] = environ.get("PYTHONPATH")
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, environ.get("PYTHONPATH", "")) if p)
    try:
        os.execve(sys.executable, [sys.executable, "-m", "multigpu.runtime.supervisor", json.dumps(spec)], environ)
    except OSError:
        return


def _device(item: list) -> Device:
    kind, index, speed, cores, memory = item
    return Device(kind, index, speed, tuple(cores), memory)


def main(argv: Sequence[str]) -> int:
    """The supervisor program :func:`become_supervisor` runs: ``python -m multigpu.runtime.supervisor SPEC``."""
    spec = json.loads(argv[0])
    if spec.get("pythonpath") is None:
        env.pop("PYTHONPATH")
    else:
        env.put("PYTHONPATH", spec["pythonpath"])
    devices = [_device(d) for d in spec["devices"]]
    return Supervisor(spec["command"], devices, spec["timeout"], shared_fds=spec["shared_fds"]).run()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)
