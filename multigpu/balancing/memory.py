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
fixed part by a least-squares line.  :data:`MARGIN` of the memory left stays
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
        self._seen: dict[int, int] = {}

    def due(self, rows: int) -> bool:
        """Whether a step at ``rows`` rows is measured (a few at each size, after its first ones)."""
        seen = self._seen.get(rows, 0)
        if seen < SKIPPED_STEPS:
            self._seen[rows] = seen + 1
            return False
        return rows > 0 and seen < SKIPPED_STEPS + MEASURED_STEPS

    def add(self, rows: int, extra: float) -> None:
        """A step at ``rows`` rows took ``extra`` bytes above what the device held before it."""
        self._seen[rows] = self._seen.get(rows, 0) + 1
        if rows > 0 and extra > 0:
            self.points[rows] = max(self.points.get(rows, 0.0), float(extra))

    def model(self) -> tuple[float, float] | None:
        """``(fixed bytes, bytes per row)``, or None before any measurement."""
        if not self.points:
            return None
        if len(self.points) == 1:
            (rows, extra), = self.points.items()
            return 0.0, extra / rows
        n = len(self.points)
        xs, ys = list(self.points), list(self.points.values())
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        fixed = my - slope * mx
        if slope <= 0 or fixed < 0:  # noise: fall back on the safe bound
            return 0.0, max(y / x for x, y in zip(xs, ys))
        return fixed, slope

    def cap(self, available: float) -> int | None:
        """The largest local batch that fits in ``available`` bytes (less :data:`MARGIN`), or None unknown."""
        found = self.model()
        if found is None or available <= 0:
            return None
        fixed, per_row = found
        return max(0, math.floor((available * (1 - MARGIN) - fixed) / per_row))
