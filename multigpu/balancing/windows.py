"""What the share search reads and says: windows of steps measured at one set of shares, and its decisions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Event", "Window", "balance_efficiency", "normalize"]


def balance_efficiency(throughput: float, solo_speeds: Sequence[float]) -> float:
    """Throughput over the sum of each device's solo throughput."""
    return throughput / sum(solo_speeds)


@dataclass(frozen=True)
class Window:
    """Steps run at one set of shares, measured on every rank alike.

    Attributes:
        ratios: the shares the steps ran with.
        samples: global samples in the window.
        seconds: wall time of the window (the slowest rank's view).
        compute: per device, seconds spent computing (not waiting).
        local: per device, samples processed.
        jitter: per device, the standard deviation of one step's compute seconds (empty: not measured).
    """

    ratios: tuple[float, ...]
    samples: int
    seconds: float
    compute: tuple[float, ...]
    local: tuple[int, ...]
    jitter: tuple[float, ...] = ()

    @property
    def throughput(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def speeds(self) -> list[float] | None:
        """Per-device compute speed (samples/s), or None when some device did no work."""
        if any(t <= 0 or n <= 0 for t, n in zip(self.compute, self.local)):
            return None
        return [n / t for n, t in zip(self.local, self.compute)]


@dataclass(frozen=True)
class Event:
    """One decision of the search, for the log.

    Attributes:
        kind: ``"scan"`` (trying ``after`` for one window of the opening scan),
            ``"scanned"`` (what ``before`` measured there), ``"probe"`` (trying
            ``after``), ``"jump"`` (trying the shares the compute speeds call
            for, or the best of the scan), ``"recheck"`` (``before`` looked
            better than the kept shares ``after``, which are measured once
            more before it is kept), ``"keep"``, ``"undo"``,
            ``"settle"``, ``"restart"``, ``"rebase"`` (the kept shares were
            measured anew).
        before: the shares before the decision.
        after: the shares after it.
        throughput_before: samples/s at ``before`` (0 when not measured).
        throughput_after: samples/s measured at the tried shares.
        reason: a few words on why.
    """

    kind: str
    before: tuple[float, ...]
    after: tuple[float, ...]
    throughput_before: float = 0.0
    throughput_after: float = 0.0
    reason: str = ""


def normalize(ratios: Sequence[float]) -> tuple[float, ...]:
    total = float(sum(ratios))
    return tuple(float(r) / total for r in ratios)
