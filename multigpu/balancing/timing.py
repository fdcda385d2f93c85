"""Where the time goes: one rank's step timings, and the shared per-step record.

For each training step a rank measures

* **wall**: from the end of its previous step to the end of this one (the
  input pipeline, Keras's own per-step work, and the step);
* **input**: the part of that time the training loop waited for the step's
  batch (reading it, or waiting for the reader);
* **step**: from the start of the step to its end;
* **compute**: the step minus the time spent inside collectives (waiting for
  the other ranks: communication that did not overlap, and imbalance).

These numbers and the step's samples travel with the step's last
collective (a few floats beside the gradients), so that after it every rank
holds every rank's numbers of the step before, with no collective of their
own.  The balancer judges shares by them; the epoch report sums them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["FIELDS", "StepRecord", "StepTiming", "format_report"]

FIELDS = ("wall", "step", "compute", "samples", "input")


@dataclass(frozen=True)
class StepRecord:
    """Every rank's measurements of one step (the same on every rank).

    Attributes:
        wall: per rank, seconds from the end of the previous step to the end of this one.
        step: per rank, seconds the step itself took.
        compute: per rank, seconds computing (the step minus waiting in collectives).
        samples: per rank, rows processed.
        input: per rank, seconds the loop waited for the step's batch.
    """

    wall: tuple[float, ...]
    step: tuple[float, ...]
    compute: tuple[float, ...]
    samples: tuple[int, ...]
    input: tuple[float, ...] = ()

    @classmethod
    def from_vector(cls, values: Sequence[float], world_size: int, complete: bool = False,
                    members: Sequence[int] | None = None) -> StepRecord | None:
        """Reads the summed vector that :meth:`StepTiming.vector` filled on each rank.

        Args:
            values: the summed timing slots.
            world_size: the number of ranks.
            complete: return None unless every rank reported (a rank that
                discarded its step makes the whole step no measurement).
            members: the ranks still in the run (default: all); a lost rank's slots stay empty.
        """
        n = world_size
        parts = [tuple(float(v) for v in values[i * n : (i + 1) * n]) for i in range(len(FIELDS))]
        present = range(n) if members is None else members
        if not any(parts[0]) or (complete and not all(parts[0][r] for r in present)):
            return None  # no rank (or, with ``complete``, not every rank) had a finished step to report
        return cls(parts[0], parts[1], parts[2], tuple(round(s) for s in parts[3]), parts[4])


class StepTiming:
    """Measures one rank's steps.

    Args:
        rank: this rank.
        world_size: number of ranks.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._start = 0.0
        self._waiting = 0.0
        self._last_end: float | None = None
        self._input = 0.0
        self._pending: tuple[float, float, float, int, float] | None = None

    def note_input(self, seconds: float) -> None:
        """The loop waited ``seconds`` for the next step's batch."""
        self._input += seconds

    def begin(self) -> None:
        """Marks the start of a step."""
        self._start = time.perf_counter()
        self._waiting = 0.0

    @contextmanager
    def waiting(self):
        """Time spent in this block counts as waiting, not computing."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._waiting += time.perf_counter() - t0

    def end(self, samples: int) -> None:
        """Marks the end of a step that processed ``samples`` rows here."""
        now = time.perf_counter()
        step = now - self._start
        wall = step if self._last_end is None else now - self._last_end
        waited = min(self._input, max(0.0, wall - step))
        self._pending = (wall, step, max(0.0, step - self._waiting), int(samples), waited)
        self._last_end = now
        self._input = 0.0

    def discard(self) -> None:
        """The step just ended is not a measurement of the shares (it compiled): it is not reported.

        Its record reaches the other ranks with this rank's slots empty, and
        the backend drops a record that lacks a rank (see
        :meth:`StepRecord.from_vector`'s ``complete``).
        """
        self._pending = None

    def break_continuity(self) -> None:
        """The next step's wall time would include more than the step (an epoch boundary, validation)."""
        self._last_end = None
        self._pending = None
        self._input = 0.0

    def vector(self) -> list[float]:
        """This rank's slots of the shared record of its last finished step (zeros elsewhere)."""
        out = [0.0] * (len(FIELDS) * self.world_size)
        if self._pending is not None:
            for i, value in enumerate(self._pending):
                out[i * self.world_size + self.rank] = float(value)
            self._pending = None
        return out

    @property
    def size(self) -> int:
        """Length of :meth:`vector`."""
        return len(FIELDS) * self.world_size


def format_report(report: dict) -> str:
    """The per-device breakdown of an epoch as a small table.

    ``input`` is the time the loop waited for batches, ``loop`` the rest of
    the time between steps (Keras's loop, callbacks), ``compute`` the step
    without collectives, ``sum`` the time the gradient sum itself took (the
    wait of the device that reached it last: the link), ``waiting`` the rest
    of the time in collectives (waiting for a slower device), ``max rows`` the
    largest local batch a device is planned (its memory's cap), where any has one.
    """
    capped = any(row.get("largest_batch") is not None for row in report["devices"])
    lines = [f"multigpu: where the time went in epoch {report['epoch'] + 1}:",
             f"  {'device':<12}{'share':>7}{'input':>7}{'loop':>7}{'compute':>9}{'sum':>6}{'waiting':>9}"
             f"{'samples/s':>11}" + (f"{'max rows':>10}" if capped else "")]
    for row in report["devices"]:
        total = row["data"] + row["compute"] + row["wait"] or 1.0
        waited = row.get("input", 0.0)
        summed = row.get("sum", 0.0)
        lines.append(
            f"  {row['device']:<12}{row['share']:>7.0%}{waited / total:>7.0%}{(row['data'] - waited) / total:>7.0%}"
            f"{row['compute'] / total:>9.0%}{summed / total:>6.0%}{(row['wait'] - summed) / total:>9.0%}"
            f"{row['samples_per_second']:>11.1f}"
            + (f"{row.get('largest_batch') if row.get('largest_batch') is not None else '-':>10}" if capped else "")
        )
    return "\n".join(lines)
