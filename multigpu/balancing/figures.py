"""What the share search compares: the kept shares' throughput, and how noisy one window is (pure Python)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from multigpu.balancing.tuning import Tuning

__all__ = ["Figures"]


@dataclass
class Figures:
    """The recent windows at the kept shares, and the noise of a window measured from them.

    Attributes:
        tuning: the thresholds (``base_windows``, ``noise_windows``, ``quiet_noise``, ``margin_noise``...).
        noise_floor: the smallest relative gain that counts as a gain.
        runs: samples/s of recent windows at the kept shares.
        differences: relative differences of successive windows at the same shares.
    """

    tuning: Tuning
    noise_floor: float
    runs: list[float] = field(default_factory=list)
    differences: list[float] = field(default_factory=list)

    def add(self, throughput: float) -> None:
        """One more window at the kept shares (its difference from the last one measures the noise)."""
        if self.runs:
            last = self.runs[-1]
            self.differences.append(abs(throughput - last) / max((throughput + last) / 2, 1e-12))
        self.runs = [*self.runs[-(self.tuning.base_windows - 1):], throughput]

    def kept(self) -> float:
        """The kept shares' samples/s: the mean of their recent windows (0 before the first)."""
        return statistics.fmean(self.runs[-self.tuning.base_windows:]) if self.runs else 0.0

    def robust(self) -> float:
        """The median of the last three windows (the mean of fewer): one low or high window does not move it."""
        recent = self.runs[-3:]
        return statistics.median(recent) if len(recent) >= 3 else statistics.fmean(recent)

    def noise(self) -> float:
        """Relative noise of one window's throughput: an estimate of its standard deviation.

        The median of the successive windows' absolute differences, over sqrt 2 (a difference
        of two windows is sqrt 2 as noisy as one), over 0.6745 (the median of ``|N(0, 1)|``):
        robust to the odd outlier window, and a standard deviation, so that "3 x noise" means
        three standard deviations.
        """
        if len(self.differences) < 2:
            return self.tuning.quiet_noise  # until measured: a quiet machine
        return statistics.median(self.differences[-self.tuning.noise_windows:]) / math.sqrt(2) / 0.6745

    def margin(self, windows: int = 1, strictness: float = 1.0) -> float:
        """How much a move measured over ``windows`` windows must beat the kept shares by to pay."""
        return max(self.noise_floor, self.tuning.margin_noise * self.noise()) * strictness / math.sqrt(windows)

    def window_factor(self) -> int:
        """How many standard windows the next measurement should last.

        Noisy measurements (a busy machine, a device throttled in bursts) are
        averaged over longer windows: the noise of a mean falls with the
        square root of its length, so a window ``k`` times longer brings a
        noise ``n`` down to ``n / sqrt(k)``; the target is ``target_noise``.
        """
        t = self.tuning
        return int(min(t.max_window_factor, max(1, round((self.noise() / t.target_noise) ** 2))))
