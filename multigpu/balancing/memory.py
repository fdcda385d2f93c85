"""What a device's training step needs of its memory, and so the largest local batch it holds.

A step's memory grows with its rows: a fixed part (gradients, the sums'
buffers, the optimizer's temporaries) and a part per row (activations and
what the backward pass keeps).  :class:`RowMemory` reads both from the peak
allocation of a device's first steps at each local batch size (the backend
measures: torch's CUDA allocator statistics, the process's peak resident
memory on a CPU device given a size) and turns the memory left into a cap.

A local batch size's first steps are not measured: they fill the kernels'
caches and record the forward pass (:mod:`multigpu.backend.torch.replay`),
which takes more than a step.  One observation gives an upper bound of the
memory per row (its fixed part counted as rows), so a cap from it is safe
where the measurement reads what the limit counts; two sizes or more separate the
fixed part by a least-squares line.  What a device keeps after a step also
grows with the largest local batch it has run (kernels' scratch space and
primitive caches, a compiled executable per size: on a CPU device given
64 MiB, torch kept 8 MiB more after its first step at 461 rows than at 242),
so the memory left before each measured size is recorded too, and the cap
counts what a larger local batch would keep beside what its step takes.
Until two sizes are measured that is taken to be as much as a row's step
takes: a first cap lies about halfway between the rows measured and what the
memory left would hold, and the next size measured tells (running out at a
size first met leaves that size's caches behind, and less room for every step
after).
:data:`MARGIN` of the memory left stays
free: allocators round sizes up and fragment.  It is small because running
out costs one step taken again (:mod:`multigpu.backend.torch.memory`), while
every row left unplanned costs every step (benchmarks/memory/README.md).
"""

from __future__ import annotations

import math

__all__ = ["MARGIN", "RowMemory"]

MARGIN = 0.10  # of the memory left, never planned
SKIPPED_STEPS = 2  # the first steps at a local batch size, not measured: they warm caches and record passes
MEASURED_STEPS = 2  # steps measured at each local batch size, after those


class RowMemory:
    """The memory of one device's steps, fixed and per row."""

    def __init__(self) -> None:
        self.points: dict[int, float] = {}  # rows -> the largest extra bytes a step at that size took
        self.room: dict[int, float] = {}  # the largest rows run -> the least memory left before a measured step
        self.top = 0  # the largest local batch measured
        self._seen: dict[int, int] = {}

    def due(self, rows: int) -> bool:
        """Whether a step at ``rows`` rows is measured (a few at each size, after its first ones)."""
        seen = self._seen.get(rows, 0)
        if seen < SKIPPED_STEPS:
            self._seen[rows] = seen + 1
            return False
        return rows > 0 and seen < SKIPPED_STEPS + MEASURED_STEPS

    def add(self, rows: int, extra: float, left: float | None = None) -> None:
        """A step at ``rows`` rows took ``extra`` bytes above what the device held before it, which had ``left``
        bytes left."""
        self._seen[rows] = self._seen.get(rows, 0) + 1
        if rows > 0 and extra > 0:
            self.points[rows] = max(self.points.get(rows, 0.0), float(extra))
        if rows > 0 and left is not None:  # what a device keeps follows the largest batch it has run
            self.top = max(self.top, rows)
            self.room[self.top] = min(self.room.get(self.top, math.inf), float(left))

    def kept_per_row(self) -> float | None:
        """Bytes the device keeps after its steps per row of its local batch (None before two sizes are
        measured): the least-squares slope of the memory left against the rows, where it falls."""
        if len(self.room) < 2:
            return None
        return max(0.0, -_slope(list(self.room), list(self.room.values())))

    def model(self) -> tuple[float, float] | None:
        """``(fixed bytes, bytes per row)``, or None before any measurement."""
        if not self.points:
            return None
        if len(self.points) == 1:
            (rows, extra), = self.points.items()
            return 0.0, extra / rows
        xs, ys = list(self.points), list(self.points.values())
        slope = _slope(xs, ys)
        fixed = sum(ys) / len(ys) - slope * sum(xs) / len(xs)
        if slope <= 0 or fixed < 0:  # noise: fall back on the safe bound
            return 0.0, max(y / x for x, y in zip(xs, ys))
        return fixed, slope

    def cap(self, available: float, rows: int = 0) -> int | None:
        """The largest local batch that fits in ``available`` bytes (less :data:`MARGIN`), measured before a step
        at ``rows`` rows: a batch larger than any run yet also keeps :meth:`kept_per_row` more a row; None
        unknown."""
        found = self.model()
        if found is None or available <= 0:
            return None
        fixed, per_row = found
        kept = self.kept_per_row()
        kept = per_row if kept is None else kept  # not measured yet: as much as a row's step takes
        rows = max(rows, self.top)
        return max(0, math.floor((available * (1 - MARGIN) - fixed + kept * rows) / (per_row + kept)))


def _slope(xs: list, ys: list) -> float:
    """The least-squares slope of ``ys`` against ``xs`` (0 where the xs do not vary)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
