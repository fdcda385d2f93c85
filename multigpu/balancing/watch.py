"""Settled shares, watched: the search starts again only when their throughput falls well beyond its noise.

Once settled, the search probes nothing: every probe is a window at worse
shares and new local batch sizes, so a settled run that kept probing would
pay for it at every probe.  Only a drop of the throughput at the kept shares
below the mean of its recent windows, well beyond the measured noise, several
windows in a row (a device slowed down, the machine's load changed), starts
the search again, and the log says by how much.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from multigpu.balancing.tuning import Tuning

__all__ = ["Watch"]


@dataclass
class Watch:
    """The throughput of the settled shares, window by window (pure Python).

    Attributes:
        tuning: the thresholds (``drop``, ``drop_noise``, ``alarms``, ``watched``).
        reference: the mean of the recent windows that did not fall (0 until the first window).
        recent: those windows.
        alarms: windows in a row that fell.
    """

    tuning: Tuning
    reference: float = 0.0
    recent: list[float] = field(default_factory=list)
    alarms: int = 0

    def start(self, reference: float = 0.0) -> None:
        """Watches from ``reference`` (samples/s), or from the next window when it is 0."""
        self.reference = reference
        self.recent = [reference] if reference > 0 else []
        self.alarms = 0

    def fell(self, throughput: float, noise: float) -> str | None:
        """Feeds one window at the settled shares; returns why the search must start again, or None.

        Args:
            throughput: the window's samples/s.
            noise: the relative noise of one window (a standard deviation).
        """
        t = self.tuning
        if not self.recent:  # the first window is the reference
            self.recent, self.reference = [throughput], throughput
            return None
        fall = max(t.drop, t.drop_noise * noise)
        dropped = throughput < self.reference * (1 - fall)
        self.alarms = self.alarms + 1 if dropped else 0
        if self.alarms < t.alarms:
            if not dropped:  # the reference is the mean of recent windows: the max of noisy ones would be too high
                self.recent = [*self.recent[-(t.watched - 1):], throughput]
                self.reference = statistics.fmean(self.recent)
            return None
        return (f"throughput fell {self.alarms} windows in a row, more than {fall:.1%} below the settled "
                f"{self.reference:.0f} samples/s (the windows' noise: {noise:.1%})")
