"""Each device's compute time per step as a fixed part plus a part per row, fitted to measured windows; the
step's expected time where the devices' steps vary (:func:`expected_max`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from multigpu.balancing.windows import Window, normalize

__all__ = ["StepCosts", "expected_max", "suggest"]


class StepCosts:
    """Each device's compute time per step as ``fixed + per_row * rows``, fitted to recent windows.

    A device's step costs more than its rows: the framework's per-step work
    (Python, kernel launches, a throttled device's bursts) is paid whatever
    the share.  Where that fixed part is large (small models, small batches,
    a slow device), shares in proportion to the speeds give the slow device
    too much: the best shares give it fewer rows, or none.  The windows at
    different shares that the search measures anyway fit both parts, by
    least squares per device over the last ``keep`` shares measured (each
    the mean of its last ``depth`` windows, so that a long stay at one share
    does not push the others out).

    Args:
        batch_size: the global batch.
        keep: how many recently measured shares the fit uses.
        spread: the smallest range of a device's rows over those shares, as a
            fraction of the batch, for the fit to be trusted.
        depth: how many recent windows a share's point averages.
    """

    def __init__(self, batch_size: int, keep: int = 8, spread: float = 0.03, depth: int = 4) -> None:
        self.batch_size = batch_size
        self.keep = keep
        self.spread = spread
        self.depth = depth
        # rows per step -> recent compute seconds per step, per device (oldest first)
        self._points: dict[tuple[float, ...], list[list[float]]] = {}

    def add(self, window: Window) -> None:
        steps = window.samples / self.batch_size
        if steps <= 0 or any(t <= 0 for t in window.compute):
            return
        rows = tuple(round(n / steps, 6) for n in window.local)
        runs = self._points.pop(rows, [])
        self._points[rows] = [*runs[-(self.depth - 1):], [t / steps for t in window.compute]]
        while len(self._points) > self.keep:
            del self._points[next(iter(self._points))]

    def clear(self) -> None:
        self._points = {}

    def describes(self, window: Window, tolerance: float = 0.25) -> bool:
        """True when the fit predicts every device's compute time in ``window`` within ``tolerance``: after a
        change of throughput, the devices are the same and the machine was noisy; otherwise a device changed."""
        costs = self.fit()
        steps = window.samples / self.batch_size
        if costs is None or steps <= 0:
            return False
        for n, t, (c, k) in zip(window.local, window.compute, costs):
            predicted = c + k * n / steps
            if predicted > 0 and abs(t / steps - predicted) > tolerance * predicted:
                return False
        return True

    def between(self, now: Sequence[int], target: Sequence[int], tolerance: float = 2.0) -> bool:
        """Whether ``target`` rows lie within the rows measured (each device's range: the fit interpolates) and no
        measured rows but ``now``'s lie on the way from ``now`` to ``target``, ``target`` included (``tolerance``
        rows in all off the straight way): throughput judged no measured share better than the kept ones, so the
        best lies short of the nearest of them."""
        points = [tuple(round(r) for r in rows) for rows in self._points]
        if not points or any(not min(p[r] for p in points) <= t <= max(p[r] for p in points)
                             for r, t in enumerate(target)):
            return False

        def apart(a: Sequence[float], b: Sequence[float]) -> float:
            return sum(abs(x - y) for x, y in zip(a, b))

        span = apart(now, target)
        return not any(apart(now, p) > tolerance and apart(now, p) + apart(p, target) <= span + tolerance
                       for p in points)

    def fit(self) -> list[tuple[float, float]] | None:
        """Per device ``(fixed seconds, seconds per row)``, or None until the windows span enough shares."""
        if len(self._points) < 3:
            return None
        points = [(rows, [statistics.fmean(run[r] for run in runs) for r in range(len(rows))])
                  for rows, runs in self._points.items()]
        out = []
        for r in range(len(points[0][0])):
            rows = [p[0][r] for p in points]
            times = [p[1][r] for p in points]
            if max(rows) - min(rows) < self.spread * self.batch_size:
                return None
            mean_b, mean_t = statistics.fmean(rows), statistics.fmean(times)
            var = sum((b - mean_b) ** 2 for b in rows)
            per_row = sum((b - mean_b) * (t - mean_t) for b, t in zip(rows, times)) / var
            fixed = mean_t - per_row * mean_b
            if per_row <= 0 or fixed < 0:  # noise beyond what two parameters can say: proportional speeds
                per_row, fixed = sum(times) / max(sum(rows), 1e-12), 0.0
            out.append((fixed, per_row))
        return out

    @staticmethod
    def step_time(shares: Sequence[int], costs: Sequence[tuple[float, float]]) -> float:
        """Predicted step time: the slowest device (a device with no rows computes nothing)."""
        return max((c + k * b if b else 0.0) for b, (c, k) in zip(shares, costs))

    def best_ratios(self, costs: Sequence[tuple[float, float]]) -> tuple[float, ...]:
        """Shares that end every device's step together: ``fixed_r + per_row_r * b_r = T`` for all devices
        with rows, ``sum(b_r) = B`` (a device whose fixed part alone exceeds ``T`` gets none)."""
        lo, hi = 0.0, max(c + k * self.batch_size for c, k in costs)
        for _ in range(60):
            t = (lo + hi) / 2
            if sum(max(0.0, (t - c) / k) for c, k in costs) < self.batch_size:
                lo = t
            else:
                hi = t
        rows = [max(0.0, (hi - c) / k) for c, k in costs]
        return normalize(rows)


def expected_max(means: Sequence[float], jitter: Sequence[float]) -> float:
    """The expected slowest of independent normal times (means and standard deviations, seconds): Clark's
    moments of the maximum of two normals, taken pairwise (C. E. Clark, Operations Research 9(2), 1961)."""
    mean, var = means[0], jitter[0] ** 2
    for m, s in zip(means[1:], jitter[1:]):
        theta = math.sqrt(var + s * s)
        if theta <= 0:
            mean, var = max(mean, m), 0.0
            continue
        a = (mean - m) / theta
        cdf, pdf = 0.5 * (1 + math.erf(a / math.sqrt(2))), math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
        first = mean * cdf + m * (1 - cdf) + theta * pdf
        second = (mean * mean + var) * cdf + (m * m + s * s) * (1 - cdf) + (mean + m) * theta * pdf
        mean, var = first, max(0.0, second - first * first)
    return mean


def suggest(now: list[int], speeds: Sequence[float], fitted: list[tuple[float, float]] | None, costs: StepCosts,
            rows: Callable[[Sequence[float]], list[int]], jitter: Sequence[float] = ()
            ) -> tuple[tuple[int, int] | None, tuple[float, ...], float]:
    """From the compute times at the current rows: the move they suggest, the shares they call for, the imbalance.

    Where the devices' steps vary (``jitter``), a step lasts as long as its slowest device *in that step*: shares
    that balance the mean times leave each device the slowest half of the time, and the step's expected time
    is above either mean.  The shares called for are then those of the shortest expected step
    (:func:`expected_max`), from the balance of the means by moves of fewer rows each time: a device whose steps
    vary more, or whose time grows faster with its rows, gets fewer rows than the balance of the means gives it,
    and waits at most steps.  The jitter is the last window's, like the speeds, and taken as the same at any rows.

    Args:
        now: each device's rows per step.
        speeds: each device's compute speed (samples/s), taken as proportional when ``fitted`` is None.
        fitted: each device's ``(fixed, per_row)`` seconds (:meth:`StepCosts.fit`), or None.
        costs: the fit (for :meth:`StepCosts.best_ratios`).
        rows: shares as rows of a global batch.
        jitter: each device's standard deviation of a step's compute seconds (:meth:`Window.jitter
            <multigpu.balancing.windows.Window>`), or empty: the means alone.

    Returns:
        ``(from the busiest device, to the least busy)`` (None when one device is both), the shares they call
        for, and the step time at ``now`` over the step time at those shares.
    """
    parts = fitted if fitted is not None else [(0.0, 1.0 / s) for s in speeds]
    proposal = costs.best_ratios(fitted) if fitted is not None else normalize(speeds)
    load = [c + k * b for b, (c, k) in zip(now, parts)]
    if len(jitter) == len(parts) and any(j > 0 for j in jitter):
        def step(shares: Sequence[int]) -> float:
            on = [i for i, b in enumerate(shares) if b]
            return expected_max([parts[i][0] + parts[i][1] * shares[i] for i in on], [jitter[i] for i in on])

        proposal = _shortest(proposal, step, rows, costs.batch_size)
        load = [t + j for t, j in zip(load, jitter)]
    else:
        def step(shares: Sequence[int]) -> float:
            return StepCosts.step_time(shares, parts)
    best, now_time = step(rows(proposal)), step(now)
    src = max(range(len(load)), key=lambda r: (load[r], -r))
    dst = min(range(len(load)), key=lambda r: (load[r], r))
    imbalance = now_time / best if best > 0 else 1.0
    return ((src, dst) if src != dst else None), tuple(proposal), imbalance


def _shortest(start: Sequence[float], step: Callable[[Sequence[int]], float],
              rows: Callable[[Sequence[float]], list[int]], batch: int) -> tuple[float, ...]:
    """The shares nearest ``start`` where no move of a part of the batch between two devices shortens ``step``,
    by moves of 1/16 of the batch, then halves, down to one row."""
    best, time = tuple(start), step(rows(start))
    n, unit = len(start), 1 / 16
    while unit * batch >= 1:
        moved = True
        while moved:
            moved = False
            for a in range(n):
                for b in range(n):
                    if a == b or best[a] < unit:
                        continue
                    trial = list(best)
                    trial[a] -= unit
                    trial[b] += unit
                    t = step(rows(trial))
                    if t < time * (1 - 1e-9):
                        best, time, moved = tuple(trial), t, True
        unit /= 2
    return normalize(best)
