"""Step records summed: over an epoch for its report, and over a window for the share search (pure Python).

Every rank reads the same :class:`~multigpu.balancing.timing.StepRecord` of
each step (the timings travel in the step's sum), so every rank's tallies
are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from multigpu.balancing.timing import StepRecord
from multigpu.balancing.windows import Window

__all__ = ["EpochTally", "SizesRun", "StepsWindow"]


class EpochTally:
    """An epoch's steps, per device: wall, step, compute and input seconds, samples; the sum's own time.

    Args:
        world_size: the run's ranks.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.totals: dict = {}
        self._first: dict = {}  # the steps that paid a local batch size's first use, summed alike
        self.reset()

    def _empty(self) -> dict:
        n = self.world_size
        return {"wall": [0.0] * n, "step": [0.0] * n, "compute": [0.0] * n, "samples": [0] * n,
                "input": [0.0] * n, "sum": 0.0, "steps": 0}

    def reset(self) -> None:
        self.totals, self._first = self._empty(), self._empty()

    def add(self, rec: StepRecord, first_use: bool = False) -> None:
        """Counts one step's record (``first_use``: the step paid its local batch sizes' first use: a trace, a
        compilation, a recorded pass; counted in the report, left out of :meth:`steady`)."""
        self._count(self.totals, rec)
        if first_use:
            self._count(self._first, rec)

    def take(self, totals: dict) -> None:
        """The epoch's totals as another rank counted them (the rank left, while the others are set aside), on every
        rank alike: its first uses are in them, not told apart (:meth:`steady` is the totals here)."""
        self.totals, self._first = totals, self._empty()

    def steady(self) -> dict:
        """The totals without the steps that paid a first use: what the devices run at sizes they ran before (the
        judgment of the devices that pay compares these, together and alone, where a new size's trace can take
        as long as twenty steps). The totals themselves where every step paid one."""
        e, f = self.totals, self._first
        if not f["steps"] or f["steps"] >= e["steps"]:
            return self.totals
        return {k: ([a - b for a, b in zip(v, f[k])] if isinstance(v, list) else v - f[k]) for k, v in e.items()}

    def _count(self, e: dict, rec: StepRecord) -> None:
        for r in range(self.world_size):
            e["wall"][r] += rec.wall[r]
            e["step"][r] += rec.step[r]
            e["compute"][r] += rec.compute[r]
            e["samples"][r] += rec.samples[r]
            e["input"][r] += rec.input[r] if rec.input else 0.0
        # The rank that reached the sum last waited for the sum alone (the link); the others' extra wait is
        # the time they waited for a slower device.
        e["sum"] += min(max(0.0, s - c) for s, c in zip(rec.step, rec.compute))
        e["steps"] += 1

    def rows(self, labels: list[str], shares: list[float], caps: list[int | None]) -> list[dict]:
        """The report's row of each device: where its time went, its samples/s, its share and largest batch."""
        e = self.totals
        rows = []
        for r, label in enumerate(labels):
            wall, step, compute = e["wall"][r], e["step"][r], e["compute"][r]
            samples = e["samples"][r]
            rows.append({
                "device": label, "share": shares[r], "data": max(0.0, wall - step),
                "input": min(e["input"][r], max(0.0, wall - step)),
                "compute": compute, "wait": max(0.0, step - compute), "samples": samples, "steps": e["steps"],
                "sum": min(e["sum"], max(0.0, step - compute)),
                "samples_per_second": samples / wall if wall else 0.0,
                "compute_samples_per_second": samples / compute if compute else 0.0,
                "largest_batch": caps[r],
            })
        return rows


@dataclass
class StepsWindow:
    """Steps summed for one window of the share search (reset at every change of shares)."""

    steps: int = 0
    seconds: float = 0.0
    samples: int = 0
    compute: list[float] = field(default_factory=list)
    local: list[int] = field(default_factory=list)
    squares: list[float] = field(default_factory=list)  # per rank, the sum of its steps' squared compute seconds

    def add(self, rec: StepRecord) -> None:
        """Counts one step: its wall time (the slowest rank's), samples, and each rank's compute and rows."""
        if not self.compute:
            n = len(rec.samples)
            self.compute, self.local, self.squares = [0.0] * n, [0] * n, [0.0] * n
        self.steps += 1
        self.seconds += max(rec.wall)
        self.samples += sum(rec.samples)
        for r, (c, n) in enumerate(zip(rec.compute, rec.samples)):
            self.compute[r] += c
            self.local[r] += n
            self.squares[r] += c * c

    def window(self, ratios: tuple[float, ...]) -> Window:
        """The steps as a window of the share search, with each rank's step-to-step standard deviation."""
        k = self.steps
        jitter = tuple(math.sqrt(max(0.0, q / k - (c / k) ** 2)) if k > 1 else 0.0
                       for c, q in zip(self.compute, self.squares))
        return Window(ratios, self.samples, self.seconds, tuple(self.compute), tuple(self.local), jitter)


class SizesRun:
    """The local batch sizes the run's steps have run at (the same on every rank: it reads the shared records)."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, ...]] = set()

    def first_use(self, rec: StepRecord) -> bool:
        """Whether the step ran local batch sizes no step had run before: it paid their first use (kernels' plans,
        buffers, a trace, a recorded or compiled pass), once per size, and is not a measure of the shares, nor
        of the devices together or alone."""
        sizes = tuple(rec.samples)
        if sizes in self._seen:
            return False
        self._seen.add(sizes)
        return True
