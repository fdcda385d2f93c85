"""Rebalancing maths: from measured speeds to shares (pure Python).

A device's speed is samples per second of its own compute (forward, backward
and optimizer work on its share, not the time it waits for the others).  With
speeds ``s_r`` the step time is ``max_r b_r / s_r``, which is smallest when
``b_r`` is proportional to ``s_r``.

:class:`Rebalancer` keeps a smoothed estimate of each device's speed and
proposes new ratios only when they would shorten the step by more than a
threshold, so that measurement noise does not make the shares flap.  Every
rank feeds it the same all-reduced measurements, so every rank reaches the
same decision.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from multigpu.planning import split

__all__ = ["Rebalancer", "balance_efficiency", "capped_split", "predicted_step_time"]


def capped_split(total: int, ratios: Sequence[float], caps: Sequence[int | None] | None = None) -> list[int]:
    """Like :func:`multigpu.planning.split`, but no device gets more than its cap.

    The excess of a capped device goes to the others in proportion to their
    ratios.

    Raises:
        ValueError: when ``total`` exceeds the sum of the caps; the message
            gives the largest global batch that fits.
    """
    if caps is None or all(c is None for c in caps):
        return split(total, ratios)
    caps = [math.inf if c is None else int(c) for c in caps]
    if sum(caps) < total:
        raise ValueError(
            f"A global batch of {total} does not fit: the devices hold at most "
            f"{[int(c) for c in caps]} samples each, so the largest global batch that fits is "
            f"{int(sum(caps))}."
        )
    shares = [0] * len(ratios)
    free = [i for i in range(len(ratios)) if caps[i] > 0 and ratios[i] > 0]
    left = total
    while left > 0:
        part = split(left, [ratios[i] for i in free])
        over = [i for i, p in zip(free, part) if shares[i] + p > caps[i]]
        if not over:
            for i, p in zip(free, part):
                shares[i] += p
            break
        for i in over:
            left -= caps[i] - shares[i]
            shares[i] = int(caps[i])
        free = [i for i in free if i not in over]
        if not free:  # pragma: no cover - excluded by the sum check
            break
    return shares


def predicted_step_time(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """Step time if device ``r`` processes ``shares[r]`` samples at ``speeds[r]``/s."""
    return max((b / s if b else 0.0) for b, s in zip(shares, speeds))


def balance_efficiency(throughput: float, solo_speeds: Sequence[float]) -> float:
    """Throughput over the sum of each device's solo throughput."""
    return throughput / sum(solo_speeds)


@dataclass
class Rebalancer:
    """Smoothed speeds and the decision to move shares.

    Args:
        ratios: the current ratios.
        smoothing: weight of a new measurement in the running speed estimate
            (exponential moving average), in (0, 1].
        threshold: move only when the predicted step time improves by more
            than this fraction (or 1.5 times the measured noise, if larger).
        batch_size: the global batch the prediction uses.
        caps: optional per-device maximum local batch.
    """

    ratios: list[float]
    smoothing: float = 0.3
    threshold: float = 0.02
    batch_size: int = 256
    caps: list[int | None] | None = None
    speeds: list[float] | None = field(default=None)
    changes: int = 0
    history: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"`smoothing` must be in (0, 1]. Received: {self.smoothing}")
        self.ratios = [float(r) for r in self.ratios]

    def observe(self, compute_seconds: Sequence[float], samples: Sequence[int]) -> bool:
        """Feeds one window of measurements; returns True if the ratios changed.

        Args:
            compute_seconds: per device, time spent computing in the window.
            samples: per device, samples processed in the window.
        """
        measured = []
        for t, n, old in zip(compute_seconds, samples,
                             self.speeds or [None] * len(samples)):
            if n > 0 and t > 0 and math.isfinite(t):
                measured.append(n / t)
            else:  # no information this window: keep the estimate
                measured.append(old)
        if any(m is None for m in measured):
            known = [m for m in measured if m is not None]
            if not known:
                return False
            fill = min(known)
            measured = [fill if m is None else m for m in measured]
        self.history = [*self.history[-7:], list(measured)]
        if len(self.history) >= 3:
            # The median of the last three windows: one outlying window (a
            # throttled device bursting after idling, a hiccup of the
            # machine) does not move the shares; a real change of speed
            # passes one window later.
            measured = [sorted(h[r] for h in self.history[-3:])[1] for r in range(len(measured))]
        if self.speeds is None:
            self.speeds = measured
        else:
            a = self.smoothing
            self.speeds = [(1 - a) * s + a * m for s, m in zip(self.speeds, measured)]
        return self.maybe_move()

    def proposal(self) -> list[float]:
        """The ratios the current speed estimate calls for."""
        assert self.speeds is not None
        total = sum(self.speeds)
        return [s / total for s in self.speeds]

    def noise(self) -> float:
        """Relative noise of one window's speed measurement, worst device.

        Estimated from successive differences (median absolute difference
        over the mean, divided by sqrt 2), which a genuine change of speed
        (a step) barely moves, unlike the plain spread of the measurements.
        """
        if len(self.history) < 4:
            return 0.0
        worst = 0.0
        for r in range(len(self.history[0])):
            series = [h[r] for h in self.history]
            diffs = sorted(abs(b - a) for a, b in itertools.pairwise(series))
            mean = sum(series) / len(series)
            if mean > 0:
                worst = max(worst, diffs[len(diffs) // 2] / mean / math.sqrt(2))
        return worst

    def maybe_move(self) -> bool:
        if self.speeds is None:
            return False
        new = self.proposal()
        current_shares = capped_split(self.batch_size, self.ratios, self.caps)
        new_shares = capped_split(self.batch_size, new, self.caps)
        if new_shares == current_shares:
            return False  # the same samples per device: nothing would change
        now = predicted_step_time(current_shares, self.speeds)
        then = predicted_step_time(new_shares, self.speeds)
        # Move only for a gain clearly above the measurement noise.
        if then < now * (1 - max(self.threshold, 1.5 * self.noise())):
            self.ratios = new
            self.changes += 1
            return True
        return False
