"""How the share search settles, and what it does once settled (a part of :class:`.search.ShareSearch`).

The search settles when no move of one sample or more pays, after
``patience`` moves in a row were undone, or when the run's steps for it are
spent (:meth:`Settling.time_up`): then, where the step costs fitted to the
shares measured call for shares between the kept ones and the nearest
measured beyond them, it settles there (:meth:`Settling._interpolate`).
Throughput may not have told the kept
shares from moves toward the balance the compute speeds call for (on a noisy
machine, shares 4 points apart measure within the windows' noise): it then
settles at the measured shares nearest that balance whose windows were within
the noise of the kept shares', unless a move on the way measured clearly
worse (:meth:`Settling._tie`).  The speeds compare the devices within the
same steps, so a drift of the whole machine does not move them, while every
throughput comparison is between windows taken at different times.  Where
local batch sizes sit on a grid and a new size costs little (TensorFlow: a
trace; not JAX, where it compiles for seconds) and the speeds' balance lies
between two of its sizes, the search settles at that balance off the grid: one
more size, never probed, whose gain is below what a window can tell
(:meth:`Settling._off_grid`).  Once settled, the throughput is watched
(:mod:`multigpu.balancing.watch`), and a fall that lasts starts the search
again, on the grid.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from multigpu.balancing.costs import suggest
from multigpu.balancing.windows import Event
from multigpu.planning.shares import capped_split, predicted_step_time

__all__ = ["Settling"]


def _describe(ratios: Sequence[float]) -> str:
    return "/".join(f"{r:.0%}" for r in ratios)


class Settling:
    """Settling and watching, for :class:`~multigpu.balancing.search.ShareSearch` (whose state they read)."""

    def time_up(self, steps: int) -> list[Event]:
        """Settles now: the run's steps for the search are spent.

        Whatever is being measured is decided on what it measured so far, against the kept shares' mean:
        a move (or the best point of the scan, one window each) is kept only when its mean is above the
        kept shares' by the margin its own windows allow (as :meth:`_judge` would with more windows);
        otherwise the kept shares stay.  Then the shares are watched like any settled ones.
        """
        before = self.figures.kept()
        events: list[Event] = []
        candidate: tuple[tuple[float, ...], float, int] | None = None  # shares, measured, windows
        if self._trial is not None and self._trial[1] != "scan" and self._trial_runs:
            candidate = (self._trial[0], statistics.fmean(self._trial_runs), len(self._trial_runs))
        elif self._confirm is not None:
            candidate = (self._confirm[0], statistics.fmean(self._confirm[2]), len(self._confirm[2]))
        elif self._scan.results:
            rate, best = max(self._scan.results)
            candidate = (best, rate, 1)
        self._trial, self._trial_runs, self._confirm = None, [], None
        self._scan.close()
        self.ratios = self.base
        if candidate is not None and before > 0:
            shares, measured, n = candidate
            margin = self.figures.margin(n, self.tuning.strict_factor)
            if measured > before * (1 + margin):
                old, self.base, self.ratios = self.base, shares, shares
                self.figures.runs = [measured]
                self.changes += 1
                events.append(Event("keep", old, shares, before, measured, f"{measured / before - 1:+.1%}"))
        elif candidate is None and not self.changes and not self._judged:
            balanced = self._balance_unjudged(steps)
            if balanced:
                return balanced
        return events + (self._interpolate(steps) or self._settle(f"after {steps} steps the search stops moving"))

    def _interpolate(self, steps: int) -> list[Event]:
        """Time is up with each device's step cost fitted (:class:`~multigpu.balancing.costs.StepCosts`: three
        shares or more measured, the opening scan's among them): where the fit's shortest expected step lies
        between the kept shares and the nearest shares measured that way, and is ``fit_gain`` shorter than at
        the kept ones, the search settles there.  Throughput judged no other measured share better than the kept
        ones, so the best lies short of the nearest of them; the costs say where within that gap,
        which the search had no steps left to probe.  Issue 65's MLP on torch: the scan's point 10% of the
        batch toward the fast device (79%/21%) beat the calibrated 69%/31% and was kept at time up, past the
        75%/25% that ran fastest of the fixed ratios."""
        if not self.fixed_costs or self._costs.fit() is None:
            return []
        _, proposal, imbalance = self._model()
        now = self.shares(self.base)
        if (proposal is None or imbalance < 1 + self.tuning.fit_gain or self.shares(proposal) == now
                or not self._costs.between(now, self.shares(proposal))):
            return []
        return self._settle_at(proposal, lambda old: (
            f"after {steps} steps the search stops moving; the step costs fitted to the shares measured call for "
            f"{_describe(proposal)}, short of the nearest shares measured beyond them (a step "
            f"{1 - 1 / imbalance:.1%} shorter than at {old}): settled there"))

    def _balance_unjudged(self, steps: int) -> list[Event]:
        """Time is up and no window judged any move (a short fit of long steps: its windows last 1.5 s): where
        the compute speeds at the kept shares are ``jump_imbalance`` out of balance, the search settles at the
        shares they call for, the jump it had no time to measure.  The speeds compare the devices within the
        same steps, where the calibration before them timed the forward and backward passes alone (a step's
        fixed work, its sum and update, also runs at a slow device's speed)."""
        _, proposal, imbalance = self._model()
        if (proposal is None or imbalance < 1 + self.tuning.jump_imbalance
                or self.shares(proposal) == self.shares(self.base)):
            return []
        return self._settle_at(proposal, lambda old: (
            f"after {steps} steps no window could judge a move: settled at the shares the compute speeds call "
            f"for, {imbalance:.2f}x out of balance at {old}"))

    def _settle_at(self, proposal: Sequence[float], why: Callable[[str], str]) -> list[Event]:
        """Settles at ``proposal``, which no window measured (time is up), watched from its first windows on;
        ``why`` says why, given the kept shares it leaves."""
        old = self.base
        self.base = self.ratios = tuple(proposal)
        self.changes += 1
        self.settle_as_found()
        return [Event("settle", tuple(old), tuple(proposal), 0.0, 0.0, why(_describe(old)))]

    def settle_as_found(self) -> None:
        """Starts settled at the given shares (found by an earlier search at another batch size): no scan, no
        probe; watched from the first windows on."""
        self.settled = True
        self._scan.close()
        self.watch.start()

    def _tie(self) -> tuple[float, ...] | None:
        """The measured shares nearest the compute speeds' balance that throughput could not tell from the kept ones.

        Only when the speeds are ``tie_imbalance`` out of balance at the kept shares, among the moves undone
        since the last kept one that lie on the way from the kept shares toward that balance (or a little
        beyond it); none if one of those measured clearly worse (``tie_noise`` noise units of a difference of
        its windows and the kept shares').
        """
        _, proposal, imbalance = self._model()
        t = self.tuning
        if proposal is None or imbalance < 1 + t.tie_imbalance or not self._judged:
            return None
        base, target = self.shares(self.base), self.shares(proposal)

        def apart(a, b) -> int:
            return sum(abs(x - y) for x, y in zip(a, b))

        span = apart(base, target)
        best: tuple[int, tuple[float, ...]] | None = None
        for ratios, relative, windows in self._judged:
            point = self.shares(ratios)
            if apart(base, point) + apart(point, target) > 1.25 * span + 2 * self.quantum:
                continue  # not on the way to the balance
            if relative < -self._clear(windows):
                return None  # a move toward the balance measured clearly worse
            if apart(point, target) < span and (best is None or apart(point, target) < best[0]):
                best = (apart(point, target), ratios)
        return best[1] if best is not None else None

    def _off_grid(self) -> tuple[tuple[float, ...], float] | None:
        """Where sizes sit on a grid (``quantum`` > 1): the compute speeds' balance and the kept shares' step time
        over the balance's, when that balance lies within one grid step of the kept sizes (the search's own
        moves, a step each way, went past it) and shortens the step by ``off_grid_gain`` at least; else None."""
        if not self.off_grid or self.quantum <= 1 or self._speeds is None:
            return None

        def rows(ratios) -> list[int]:
            return capped_split(self.batch_size, ratios, self.caps)

        now = self.shares(self.base)  # (within a grid step, each device's time per row at its rows now)
        _, proposal, imbalance = suggest(now, self._speeds, None, self._costs, rows, self._jitter())
        target = rows(proposal)
        if (imbalance < 1 + self.tuning.off_grid_gain or target == now
                or max(abs(a - b) for a, b in zip(target, now)) >= self.quantum or not self._speeds_hold(now)):
            return None
        return tuple(proposal), imbalance

    def _speeds_hold(self, now: list[int]) -> bool:
        """Whether the last window's compute speeds describe the moves throughput judged since the last kept one.

        A throttled device's speed moves from window to window (its quota lets it run ahead in bursts), and the
        balance off the grid is taken from one window's speeds, unmeasured: where a move judged clearly worse
        than those speeds predict (by more than ``tie_noise`` noise units of its windows and the kept shares'),
        they are not the devices' and the search stays on the grid.  TensorFlow's demo: speeds calling for
        321 + 191 rows beside 336 + 176 kept, where 304 + 208 had measured 13% slower (they predicted 4%); the
        slow device then computed its 191 rows in 129 ms a step against the other's 321 in 106 ms.
        """
        before = predicted_step_time(now, self._speeds)
        for ratios, relative, windows in self._judged:
            predicted = before / predicted_step_time(self.shares(ratios), self._speeds) - 1
            if relative < predicted - self._clear(windows):
                return False
        return True

    def _clear(self, windows: int) -> float:
        """How far a move measured over ``windows`` windows must fall from the kept shares' (or from what the speeds
        predict) to count as clearly worse: ``tie_noise`` noise units of its windows and the kept shares'."""
        t = self.tuning
        return max(self.noise_floor, t.tie_noise * self.noise() * math.sqrt(1 / windows + 1 / t.base_windows))

    def _settle(self, why: str = "no move of one sample or more pays") -> list[Event]:
        tie = self._tie()
        fine = self._off_grid() if tie is None else None
        if fine is not None:
            old, (shares, imbalance) = self.base, fine
            self.quantum = 1  # one size off the grid; a search started again returns to it (:meth:`_watch`)
            self.base = self.ratios = shares
            self.changes += 1
            self._judged = []
            self._undone = 0
            self.settle_as_found()
            rows = " + ".join(str(b) for b in self.shares(shares))
            before = " + ".join(str(b) for b in capped_split(self.batch_size, old, self.caps, self.grid))
            why += (f"; the compute speeds call for {rows} rows, between two sizes of the grid (a step "
                    f"{1 - 1 / imbalance:.1%} shorter than at {before}): settled there")
            return [Event("settle", tuple(old), tuple(shares), 0.0, 0.0, why)]
        if tie is not None:
            old = self.base
            self.base, self.ratios = tie, tie
            self.changes += 1
            self._judged = []
            self._undone = 0
            self.settle_as_found()  # watched from its first windows on
            why += (f"; throughput could not tell {_describe(tie)} from {_describe(old)}: settled at the shares "
                    "nearest the compute speeds' balance")
            return [Event("settle", tuple(old), tuple(tie), 0.0, 0.0, why)]
        self.settled = True
        self.watch.start(self.figures.kept())
        self._undone = 0
        return [Event("settle", tuple(self.ratios), tuple(self.ratios), self.watch.reference, 0.0, why)]

    def _watch(self, throughput: float) -> list[Event]:
        """Settled: the search starts again only when :class:`Watch` says the throughput fell (saying why)."""
        why = self.watch.fell(throughput, self.noise())
        if why is None:
            return []
        self.settled = False
        self.quantum = self.grid  # (settled off the grid: the search moves on it again)
        self.step = self.first_step
        self._tried.clear()
        self._momentum = None
        self._jumps.clear()
        self._judged = []
        self._costs.clear()  # windows from before a change of speed describe other devices
        self.figures.runs = self.figures.runs[-1:]
        events = [Event("restart", tuple(self.ratios), tuple(self.ratios), self.watch.reference, throughput, why)]
        return events + self._propose()
