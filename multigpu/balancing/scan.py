"""The share search's opening scan: one window each at far shares, before it moves step by step.

Throughput is not always a single hill: a throttled device given few rows
runs them within its bursts, and a step-by-step search stops on the plateau
before.  So the search first measures one window each at the shares the
compute speeds call for and at moves of 10% and 25% of the batch both ways
between the two devices the speeds point at; the best, if it beats the start,
is measured again like any move (on a stricter test: it is the best of
several noisy windows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Scan"]

Shares = tuple[float, ...]


@dataclass
class Scan:
    """The scan's points and what each measured (pure Python).

    Attributes:
        fractions: the moves, as fractions of the batch (``()``: no scan, as where every new local batch size
            compiles).
        opened: the points were chosen (once per search).
        queue: the points not measured yet.
        results: ``(samples/s, shares)`` of the points measured.
    """

    fractions: tuple[float, ...]
    opened: bool = False
    queue: list[Shares] = field(default_factory=list)
    results: list[tuple[float, Shares]] = field(default_factory=list)

    def open(self, base: Sequence[float], proposal: Sequence[float] | None, pair: tuple[int, int] | None,
             moved: Callable[[tuple[int, int], float], Shares | None], rows: Callable[[Sequence[float]], list[int]],
             ) -> None:
        """Chooses the points: the speeds' shares (if at least half the smallest move away), then the moves.

        Args:
            base: the kept shares.
            proposal: the shares the compute speeds call for, if known.
            pair: the devices to move rows between (from, to), if known.
            moved: ``base`` with a fraction of the batch moved along a pair (None where nothing moves).
            rows: shares as rows of a global batch (points with the same rows are measured once).
        """
        self.opened = True
        if not self.fractions:
            return
        far = proposal is not None and max(abs(a - b) for a, b in zip(proposal, base)) >= self.fractions[0] / 2
        points: list[Shares | None] = [tuple(proposal)] if far and proposal is not None else []
        if pair is not None:
            points += [moved(p, d) for d in self.fractions for p in (pair, (pair[1], pair[0]))]
        seen = {tuple(rows(base))}
        for point in points:
            key = tuple(rows(point)) if point is not None else None
            if point is not None and key not in seen:
                seen.add(key)
                self.queue.append(point)

    def best(self) -> tuple[float, Shares] | None:
        """The best point measured (and forgets the results), or None."""
        found = max(self.results) if self.results else None
        self.results = []
        return found

    def close(self) -> None:
        """Stops the scan where it is (the search's time is up)."""
        self.opened = True
        self.queue, self.results = [], []
