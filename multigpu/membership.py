"""Who is still in a run: lost devices, the record of members, heartbeats, and fault injection.

A leaf every layer may import.  Under multigpu's own supervisor, a run
parallelized with ``min_devices`` below its device count goes on without a
device it loses:

* each rank beats (:func:`start_heartbeat`: a file in the run's folder
  touched every :data:`BEAT` s by a thread of its own) and says the run may
  shrink (:func:`allow_shrink`);
* the supervisor declares a rank lost when its process dies by a signal (an
  out-of-memory kill, a ``SIGKILL``, a crash in C code) or stops beating for
  :data:`LOST_AFTER` s (stopped, or stuck holding the interpreter); it ends
  such a process, and writes the new :class:`Members` record (a generation
  number, the ranks left, who was lost) in the run's folder;
* the survivors, waiting in a collective the lost rank never reaches, read the
  record (:func:`read`) and raise :class:`PeerLostError`; the backend forms a new
  process group of the survivors, and the step is done again on the whole
  global batch by the shares of the devices left.

A rank that raises an exception of its own is not lost but failed: the same
error would most likely follow on every rank, so the run ends as before.

With restarts left (``multigpu run --max-restarts K``) the supervisor starts
the lost rank's process again, with :data:`multigpu.env.REJOIN` set.  The
new process runs the script up to its ``fit`` and says it is ready
(:func:`say_ready`); the supervisor writes a record with it among the
members again; the others see that record (the heartbeat thread reads it:
:func:`latest`), agree in their next gradient sum to welcome it, and at the
following step form a group with it, send it the position in the run and
the state, and plan that step's global batch over every device again.

``MULTIGPU_FAULT`` (a testing aid) kills named ranks at named points:
``RANK:POINT[:N]`` entries separated by commas, the rank killed with
``SIGKILL`` (or stopped with ``SIGSTOP`` for ``POINT/stop``) at its ``N``-th
time at ``POINT`` (default 1); the points are in :data:`POINTS`.
``RANK:sum/drop[:N]`` kills nothing: rank ``RANK`` throws away the result
of its ``N``-th sum as if its collective had failed, which is what a ring
collective broken midway by a lost peer leaves (the sum reached some ranks
and not others, so some applied the step and others did not); with a rank
killed at the same step it makes the survivors disagree on the steps done.
``RANK:forward/oom[:N]`` kills nothing either: rank ``RANK``'s ``N``-th
training step raises ``MemoryError`` in its forward pass, as a full device.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from multigpu import env

__all__ = ["BEAT", "LOST_AFTER", "POINTS", "Members", "PeerLostError", "allow_shrink", "at", "await_change",
           "await_welcome", "beat_age", "dropped", "fault_out_of_memory", "forget_rank", "is_ready", "latest",
           "open_welcome", "read", "say_ready", "shrink_allowed", "start_heartbeat", "welcomed", "write"]

BEAT = 0.5  # seconds between a rank's heartbeats
LOST_AFTER = 5.0  # seconds without a heartbeat after which a rank is lost
POINTS = ("forward", "sum", "update", "input", "validation", "save")
_RECORD = "members.json"


@dataclass(frozen=True)
class Members:
    """The ranks of a run, as the supervisor last wrote them.

    Attributes:
        generation: 0 at the start, one more at each change.
        members: the ranks still in the run, in rank order.
        members: the ranks in the run, in the order of the process group (survivors first, then ranks that
            rejoined, in the order they came back).
        lost: one entry per loss: ``rank``, ``device``, ``why``, ``at`` (Unix time).
        joined: one entry per rank that came back: ``rank``, ``device``, ``at``.
    """

    generation: int
    members: tuple[int, ...]
    lost: tuple[dict, ...] = field(default_factory=tuple)
    joined: tuple[dict, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "members": list(self.members), "lost": list(self.lost),
                           "joined": list(self.joined)})

    @classmethod
    def from_json(cls, text: str) -> Members:
        data = json.loads(text)
        return cls(int(data["generation"]), tuple(int(r) for r in data["members"]), tuple(data.get("lost", ())),
                   tuple(data.get("joined", ())))

    def newcomers(self, members) -> list[int]:
        """The ranks of this record that are not among ``members`` (ranks coming back)."""
        return [r for r in self.members if r not in members]


class PeerLostError(Exception):
    """Another rank left the run while this one waited for it; ``members`` is the run without it."""

    def __init__(self, members: Members) -> None:
        lost = ", ".join(f"rank {e['rank']} ({e['device']})" for e in members.lost)
        super().__init__(f"lost {lost}; the run goes on with ranks {list(members.members)}")
        self.members = members


# ------------------------------------------------------------------ the record
def write(run_dir: str | os.PathLike, members: Members) -> None:
    """Writes the record atomically (the supervisor)."""
    path = Path(run_dir) / _RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(members.to_json())
    os.replace(tmp, path)


def read(run_dir: str | os.PathLike | None) -> Members | None:
    """The record, or None when there is none (no run folder, or nobody was ever lost)."""
    if not run_dir:
        return None
    try:
        return Members.from_json((Path(run_dir) / _RECORD).read_text())
    except (OSError, ValueError, KeyError):
        return None


def await_change(run_dir: str | None, generation: int, seconds: float) -> Members | None:
    """Waits up to ``seconds`` for a record newer than ``generation`` (a collective failed: was a peer lost?)."""
    deadline = time.monotonic() + seconds
    while True:
        found = read(run_dir)
        if found is not None and found.generation > generation:
            return found
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


# ------------------------------------------------------------------ a rank's side
def allow_shrink(rank: int, min_devices: int) -> None:
    """Tells the supervisor this run may go on with ``min_devices`` devices or more."""
    run_dir = env.get(env.RUN_DIR)
    if run_dir:
        path = Path(run_dir) / f"rank{rank}.min_devices"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(int(min_devices)))
        os.replace(tmp, path)


def shrink_allowed(run_dir: str | None, ranks) -> int | None:
    """The ``min_devices`` one of ``ranks`` said (the supervisor's side), or None."""
    for r in ranks:
        try:
            text = (Path(run_dir or ".") / f"rank{r}.min_devices").read_text().strip() if run_dir else ""
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


_BEATING: threading.Thread | None = None
_LATEST: Members | None = None  # the record as the heartbeat thread last read it


def start_heartbeat(rank: int) -> None:
    """Touches ``rank<r>.beat`` in the run's folder every :data:`BEAT` s, from a daemon thread, which also reads
    the record of members when it changes (:func:`latest`)."""
    global _BEATING
    run_dir = env.get(env.RUN_DIR)
    if not run_dir or _BEATING is not None:
        return
    path = Path(run_dir) / f"rank{rank}.beat"
    record = Path(run_dir) / _RECORD

    def beat() -> None:
        global _LATEST
        seen = None
        while True:
            try:
                path.touch()
            except OSError:  # the folder is gone: the supervisor is too
                return
            try:
                stamp = record.stat().st_mtime_ns
            except OSError:
                stamp = None
            if stamp != seen:
                seen, _LATEST = stamp, read(run_dir)
            time.sleep(BEAT)

    _BEATING = threading.Thread(target=beat, name="multigpu-heartbeat", daemon=True)
    _BEATING.start()


def beat_age(run_dir: str | None, rank: int, now: float) -> float | None:
    """Seconds since ``rank`` last beat (None: it never did)."""
    if not run_dir:
        return None
    try:
        return now - os.stat(os.path.join(run_dir, f"rank{rank}.beat")).st_mtime
    except OSError:
        return None


def latest() -> Members | None:
    """The record of members as this rank's heartbeat thread last read it (at most :data:`BEAT` s old)."""
    return _LATEST


# ------------------------------------------------------------------ coming back
def say_ready(rank: int) -> None:
    """A restarted rank reached its ``fit``: the supervisor may count it among the members again."""
    run_dir = env.get(env.RUN_DIR)
    if run_dir:
        (Path(run_dir) / f"rank{rank}.ready").touch()


def is_ready(run_dir: str, rank: int) -> bool:
    """Whether restarted ``rank`` said it is ready (the supervisor's side)."""
    return os.path.exists(os.path.join(run_dir, f"rank{rank}.ready"))


def forget_rank(run_dir: str, rank: int) -> None:
    """Removes what a lost rank's process left in the run's folder (its beat, its word), before it starts again."""
    for name in (f"rank{rank}.beat", f"rank{rank}.ready", f"rank{rank}.failure"):
        try:
            os.unlink(os.path.join(run_dir, name))
        except OSError:
            pass


def open_welcome(run_dir: str, generation: int) -> None:
    """The ranks in the run are forming generation ``generation``'s group with the ranks coming back."""
    (Path(run_dir) / f"welcome-{generation}").touch()


def welcomed(run_dir: str, generation: int) -> bool:
    """Whether the ranks in the run formed generation ``generation``'s group, or a later one (the supervisor's
    side: a rank counted again in ``generation`` is in their group from then on)."""
    for path in Path(run_dir).glob("welcome-*"):
        suffix = path.name.removeprefix("welcome-")
        if suffix.isdigit() and int(suffix) >= generation:
            return True
    return False


def await_welcome(run_dir: str, generation: int) -> None:
    """Waits (as long as the run lasts: the supervisor ends a rank still waiting when the others finish) until the
    ranks in the run form generation ``generation``'s group; they do so at a step of ``fit``."""
    path = Path(run_dir) / f"welcome-{generation}"
    while not path.exists():
        time.sleep(0.02)


# ------------------------------------------------------------------ fault injection
_PLAN: dict[str, tuple[int, str]] | None = None  # this rank's points -> (nth time, "kill", "stop" or "drop")
_COUNTS: dict[str, int] = {}
_MODES = {"stop": POINTS, "drop": ("sum",), "oom": ("forward",)}  # POINT/MODE: the points each mode applies to


def _plan(rank: int) -> dict[str, tuple[int, str]]:
    global _PLAN
    if _PLAN is None:
        _PLAN = {}
        for entry in filter(None, (env.get(env.FAULT) or "").split(",")):
            parts = entry.strip().split(":")
            point, _, mode = parts[1].partition("/") if len(parts) > 1 else ("", "", "")
            if (len(parts) not in (2, 3) or point not in POINTS or not parts[0].isdigit()
                    or (mode and point not in _MODES.get(mode, ())) or not (len(parts) == 2 or parts[2].isdigit())):
                raise ValueError(f"{env.FAULT} takes RANK:POINT[:N] entries, POINT one of {', '.join(POINTS)} "
                                 "(with /stop to stop the rank instead of killing it, sum/drop to throw away "
                                 f"the result of a sum, forward/oom to run out of memory). Received: {entry!r}")
            if int(parts[0]) == rank:
                _PLAN[parts[1]] = (int(parts[2]) if len(parts) == 3 else 1, mode or "kill")
    return _PLAN


def _due(key: str, rank: int) -> tuple[int, str] | None:
    """The plan's entry for ``key`` when this is its ``N``-th time (counted per key), else None."""
    if _PLAN == {}:
        return None
    planned = _plan(rank).get(key)
    if planned is None:
        return None
    _COUNTS[key] = _COUNTS.get(key, 0) + 1
    return planned if _COUNTS[key] == planned[0] else None


def at(point: str, rank: int) -> None:
    """A fault point: kills (or stops) this rank here if ``MULTIGPU_FAULT`` says so (a testing aid)."""
    planned = _due(point, rank)
    if planned is None and _PLAN:
        planned = _due(f"{point}/stop", rank)
    if planned is not None:
        os.kill(os.getpid(), signal.SIGSTOP if planned[1] == "stop" else signal.SIGKILL)


def out_of_memory(rank: int) -> bool:
    """Whether ``MULTIGPU_FAULT`` says this rank's training step runs out of memory now (``RANK:forward/oom``)."""
    return _due("forward/oom", rank) is not None


def fault_out_of_memory(rank: int) -> None:
    """Raises ``MemoryError`` where :func:`out_of_memory` says this rank's training step runs out now."""
    if out_of_memory(rank):
        raise MemoryError("out of memory (MULTIGPU_FAULT forward/oom, a testing aid)")


def dropped(point: str, rank: int) -> bool:
    """Whether ``MULTIGPU_FAULT`` says this rank throws away what it received at ``point`` this time."""
    return _due(f"{point}/drop", rank) is not None
