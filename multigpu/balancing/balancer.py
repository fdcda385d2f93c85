"""The load balancer: the one owner of the shares of a parallel model.

Everything that needs the shares asks the balancer: the data path plans each
global batch through :attr:`LoadBalancer.planner` (which calls
:meth:`LoadBalancer.shares`), the training step takes the plan back and weights
its gradients by it, and after every step the balancer reads the shared
:class:`~multigpu.balancing.timing.StepRecord` of the step before (every rank
holds the same one) and may move the shares for the next batches.  Nothing
else changes them.

Shares come from, in order: the ratios the user gave; a profile of an earlier
run; calibration (every device times a few solo passes at the first step);
then, while training, the throughput-judged search of
:mod:`multigpu.balancing.search`.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from multigpu.balancing.advice import Advice, describe_shares
from multigpu.balancing.options import BalanceOptions
from multigpu.balancing.parking import Parking
from multigpu.balancing.profiles import ProfileError, default_profile_path, profile_key, read_profile, write_profile
from multigpu.balancing.search import ShareSearch
from multigpu.balancing.tally import EpochTally, SizesRun, StepsWindow
from multigpu.balancing.timing import StepRecord, format_report
from multigpu.balancing.windows import Event
from multigpu.planning.plan import StepPlanner
from multigpu.planning.shares import split_once

__all__ = ["BalanceOptions", "LoadBalancer", "describe_shares"]

WINDOW_SECONDS = 1.5
WINDOW_STEPS = 3
# The search settles by the end of the first two epochs, and never before this many steps: every move is a
# window at worse shares and new local batch sizes, and on a noisy machine a search that goes on keeps
# probing (issue 54: windows at one share spread as much as the moves they judge).
SETTLE_STEPS = 40
# A device's measured cap moves only when a measurement at another local batch size differs by more than this:
# each move is a new local batch size (a slow first step, steps unmeasured) for a few rows.
CAP_TOLERANCE = 0.05


class LoadBalancer:
    """Owns the current ratios of one parallel model.

    Args:
        devices: every rank's device (``label`` and ``spec`` are used).
        rank: this process's rank.
        options: the user's choices.
        log: prints one line (rank 0 only).
    """

    def __init__(self, devices: Sequence, rank: int, options: BalanceOptions,
                 log: Callable[[str], None]) -> None:
        self.devices = list(devices)
        self.rank = rank
        self.world_size = len(devices)
        self.options = options
        # Caps of the devices' memory: given (max_batch), measured (the memory per row), and from an
        # out-of-memory error (rows it could not hold); the plans keep within the smallest.
        self._caps: dict[str, list[int | None]] = {
            "given": list(options.caps) if options.caps is not None else [None] * len(devices),
            "measured": [None] * len(devices), "ran_out": [None] * len(devices)}
        self._log = log
        self.log = log  # the run's log (rank 0 prints it), for the steps' own lines
        fixed = options.spec.values if options.spec.kind == "fixed" else None
        self.ratios: list[float] = list(fixed) if fixed else [1.0] * self.world_size
        self.speeds: list[float] | None = None
        self.solo_speeds: list[float] | None = None
        self.calibrated = not options.auto
        self.batch_size: int | None = None
        self.search: ShareSearch | None = None
        self.events: list[Event] = []
        self.last_report: dict | None = None
        self.planner = StepPlanner(self.shares, rank)
        self._window = StepsWindow()
        self._sizes = SizesRun()  # the local batch sizes every rank has run a step at
        self.tally = EpochTally(self.world_size)  # this epoch's steps, as every rank recorded them
        self._changed = False
        self.advice = Advice(self.devices, log, options.compression)
        self.lost: list[int] = []  # ranks lost during the run: their share is 0 from then on
        self._remeasure = False  # automatic shares after a loss: measure the devices left once
        self._before_loss: dict[int, float] = {}  # a lost rank's ratio when it was lost
        self._settle_by = SETTLE_STEPS  # steps of a fit by which its search settles
        self._fit_start = 0  # the planner's steps when this fit began: the search settles by ``_settle_by`` more
        self._announced = False  # the run's devices and shares said once, at its first fit
        self.parking = Parking(self.devices, log)  # the devices that do not pay, set aside

    def ratios_with(self, ranks: Sequence[int]) -> list[float]:
        """The ratios with lost ``ranks`` back: fixed ratios as given, automatic ones as they were at the loss."""
        fixed = self.options.spec.values if self.options.spec.kind == "fixed" else None
        out = list(self.ratios)
        for r in ranks:
            out[r] = float(fixed[r]) if fixed else self._before_loss.get(r, sum(out) / max(1, len(out)))
        return out

    def rejoined(self, ratios: Sequence[float], out: Sequence[int]) -> None:
        """Lost ranks came back: ``ratios`` (the leader's :meth:`ratios_with`) on every rank, ``out`` the ranks
        still lost; automatic shares are measured once more over the devices now in the run, then kept."""
        self.ratios = [float(r) for r in ratios]
        self.lost = list(out)
        self.calibrated = True
        self.search = None
        self._sizes = SizesRun()  # the process started again pays every size's first use again: every rank alike
        self._window = StepsWindow()
        self._changed = False
        self._remeasure = self.options.auto and self.options.rebalance

    def set_ratios(self, ratios: Sequence[float]) -> None:
        """The shares from the next plan on, as devices are set aside or come back (every rank alike)."""
        self.ratios = [float(r) for r in ratios]
        self._window = StepsWindow()

    def drop(self, ranks: Sequence[int]) -> None:
        """Gives lost ranks no rows from now on; the others keep their shares relative to each other.

        The search stops.  Fixed ratios stay as they are; automatic shares are
        measured once more over the devices left (their compute speeds over a
        window of steps, which change when a lost device shared their
        processor or their link), then kept.  The profile is not written again.
        """
        for r in ranks:
            if r not in self.lost:
                self.lost.append(r)
                self._before_loss[r] = self.ratios[r]
                self.ratios[r] = 0.0
        self.search = None
        self._window = StepsWindow()
        self._changed = False
        self._remeasure = self.options.auto and self.options.rebalance

    def _measure_survivors(self, rec: StepRecord, first: bool) -> None:
        """After a loss (or a rank's return), with automatic shares: the compute speeds of the devices in the run
        over one window set them (``first``: the step paid its sizes' first use, not a measure)."""
        if first:
            return
        w = self._window
        w.add(rec)
        if w.steps < WINDOW_STEPS or w.seconds < WINDOW_SECONDS:
            return
        left = [r for r in range(self.world_size) if r not in self.lost]
        if any(w.compute[r] <= 0 or w.local[r] <= 0 for r in left):
            return
        speeds = [0.0 if r in self.lost else w.local[r] / w.compute[r] for r in range(self.world_size)]
        self.ratios = [v / sum(speeds) for v in speeds]
        self.speeds = speeds
        self._remeasure = False
        self._window = StepsWindow()
        detail = ", ".join(f"{self.devices[r].label} {speeds[r]:.0f} samples/s" for r in left)
        shares = describe_shares([self.ratios[r] for r in left])
        self._log(f"measured the devices in the run: {detail} -> shares {shares}")

    def lower_cap(self, rank: int, rows: int) -> None:
        """``rank``'s device holds at most ``rows`` rows from now on (it ran out of memory above them): every
        plan from here, the search's included, keeps within it."""
        old = self._caps["ran_out"][rank]
        self._caps["ran_out"][rank] = max(0, int(rows)) if old is None else min(old, max(0, int(rows)))
        self._apply_caps()

    def measured_cap(self, rank: int, rows: int) -> bool:
        """``rank``'s device holds about ``rows`` rows, by its measured memory per row; returns whether the plans
        of the current global batch change (the cap now binds there)."""
        old = self._caps["measured"][rank]
        if old is not None and abs(int(rows) - old) <= CAP_TOLERANCE * old:
            return False  # a measurement at another local batch size that says the same: the cap stays put
        before = self.shares(self.batch_size) if self.batch_size else None
        self._caps["measured"][rank] = int(rows)
        self._apply_caps()
        return bool(self.batch_size) and self.shares(self.batch_size) != before

    def cap_of(self, rank: int) -> int | None:
        """The largest local batch ``rank``'s device is planned (None: no cap)."""
        return None if self.options.caps is None else self.options.caps[rank]

    def _apply_caps(self) -> None:
        caps = [None if all(c is None for c in cs) else min(c for c in cs if c is not None)
                for cs in zip(*self._caps.values())]
        self.options.caps = None if all(c is None for c in caps) else caps
        if self.search is not None:  # (its windows go on: a step at other shares than the search's starts anew)
            self.search.caps = self.options.caps

    # ------------------------------------------------------------- queries
    def shares(self, total: int) -> list[int]:
        """Rows per rank of a global batch of ``total`` rows, by the current ratios."""
        return list(split_once(total, tuple(self.ratios), tuple(self.options.caps or ()) or None, self.quantum))

    @property
    def quantum(self) -> int:
        """Local batch sizes are multiples of this many rows (plus a global batch's remainder on one device), where
        shares move (automatic shares; fixed shares have their sizes once and for all); 1 once the search settled
        at the speeds' balance between two sizes of the grid (one size off it)."""
        grid = self.options.grid if self.options.auto else 0
        q = max(1, self.batch_size // grid) if grid and self.batch_size else 1
        return min(q, self.search.quantum) if self.search and self.search.batch_size == self.batch_size else q

    @property
    def searching(self) -> bool:
        """The share search is moving (not settled): every step it judges should be a steady one."""
        return self.search is not None and not self.search.settled

    def describe(self) -> str:
        """One line naming the devices and their current shares."""
        total = sum(self.ratios)
        parts = [f"{d.label} {r / total:.0%}" + ("" if self.cap_of(i) is None else f" (at most {self.cap_of(i)} rows)")
                 for i, (d, r) in enumerate(zip(self.devices, self.ratios))]
        return f"multigpu: {self.world_size} device(s): " + ", ".join(parts)

    # ------------------------------------------------------------- the run
    def begin_fit(self, batch_size: int | None, signature: Callable[[], str],
                  steps_per_epoch: int | None = None) -> None:
        """Called when ``fit`` starts: the nominal global batch, and the profile if asked for."""
        if batch_size:
            self.shares(batch_size)  # a batch no cap allows fails here, on every rank
        self.batch_size = batch_size or self.batch_size
        self._settle_by = max(SETTLE_STEPS, 2 * int(steps_per_epoch or 0))
        self._fit_start = self.planner.taken
        self._signature = signature
        self.parking.begin_fit()
        if not self.calibrated and not self.options.recalibrate:
            self._from_profile()
        self._announce(batch_size)
        self._start_search()

    def _announce(self, batch_size: int | None) -> None:
        """Says once which devices the run uses and how the first batch is split (rank 0)."""
        if self._announced:
            return
        self._announced = True
        line = f"{self.world_size} devices ({', '.join(d.label for d in self.devices)})"
        if batch_size:
            rows = self.shares(batch_size)
            line += (f", shares {describe_shares(self.ratios)} ({' + '.join(map(str, rows))} rows of each batch "
                     f"of {batch_size})")
        if not self.calibrated:
            line += "; measuring each device at the first step, then searching the shares"
        elif not self.options.auto:
            line += f", by ratios {':'.join(f'{r:g}' for r in self.ratios)}"
        self._log(line)

    def _profile_path(self) -> Path:
        return Path(self.options.profile) if self.options.profile else default_profile_path()

    def _key(self) -> str:
        return profile_key(self._signature(), [d.spec for d in self.devices])

    def _from_profile(self) -> None:
        path = self._profile_path()
        try:
            entry = read_profile(path, self._key(), [d.spec for d in self.devices])
        except ProfileError as exc:
            if path.exists() and self.rank == 0:
                warnings.warn(f"multigpu: cannot use the profile ({exc}); calibrating instead.", stacklevel=2)
            return
        self.ratios = [float(r) for r in entry["ratios"]]
        self.speeds = entry.get("speeds")
        self.calibrated = True
        self._log(f"shares {describe_shares(self.ratios)} from the profile {path}")

    def calibrate(self, solo: Callable[[], tuple[float, float]], all_reduce: Callable[[list[float]], list[float]],
                  steps_per_epoch: int | None) -> None:
        """Sets the shares from every device's solo speed (a collective; at the first step).

        Args:
            solo: runs this rank's solo passes; returns ``(samples/s, seconds spent)``.
            all_reduce: sums a list of floats over ranks.
            steps_per_epoch: for the log line's cost estimate.
        """
        self.calibrated = True
        speed, spent = solo()
        n = self.world_size
        vec = [0.0] * (2 * n)
        vec[self.rank], vec[n + self.rank] = speed, spent
        vec = all_reduce(vec)
        speeds, spent = vec[:n], max(vec[n:])
        if all(v > 0 for v in speeds):
            self.ratios = [v / sum(speeds) for v in speeds]
            self.speeds = list(speeds)
            self.solo_speeds = list(speeds)
        epoch = (steps_per_epoch or 1) * (self.batch_size or 1) / max(sum(v for v in speeds if v > 0), 1e-9)
        detail = ", ".join(f"{d.label} {v:.0f} samples/s" for d, v in zip(self.devices, speeds))
        self._log(f"calibrated in {spent:.1f} s ({spent / max(epoch, 1e-9):.1%} of an epoch): "
                  f"{detail} -> shares {describe_shares(self.ratios)}")
        self._changed = True
        self._start_search()

    def _start_search(self) -> None:
        if not (self.options.rebalance and self.calibrated and self.batch_size and self.world_size > 1) or self.lost:
            return
        if self.search is None or self.search.batch_size != self.batch_size:
            settled = self.search is not None and self.search.settled
            q, o, b = self.quantum, self.options, self.batch_size
            self.search = ShareSearch(list(self.ratios), b, o.caps, first_step=max(0.04, q / b), min_step=q / b,
                                      quantum=q, off_grid=o.off_grid, scan=ShareSearch.scan if o.scan else ())
            if settled:  # a new batch size in a later fit: the shares found stay, watched as settled ones
                self.search.settle_as_found()
            self._window = StepsWindow()

    # ------------------------------------------------------------- records
    def record(self, rec: StepRecord | None) -> None:
        """Reads the shared record of a finished step (the same on every rank)."""
        if rec is None:
            return
        first = self._sizes.first_use(rec)
        self.tally.add(rec, first)
        if self.parking.parked:
            return self.parking.observe(rec, first)  # (the ranks set aside take no step: on the ranks left only)
        if self._remeasure:
            self._measure_survivors(rec, first)
            return
        self._search_on(rec, first)

    def caught_up(self, rec: StepRecord | None, ratios: Sequence[float], before_loss: dict[int, float]) -> None:
        """On a rank whose sum a loss cut short after other ranks had it: the step's record counted in the
        epoch's report, and the shares of a rank that read it in time (:meth:`record` there may have moved
        them before the loss dropped the lost rank's), so that every rank plans alike from here."""
        if rec is not None:
            self.tally.add(rec, self._sizes.first_use(rec))
        self.ratios = [float(r) for r in ratios]
        self._before_loss = dict(before_loss)

    def catch_up_state(self) -> dict:
        """What :meth:`caught_up` takes from a rank that read the step's record in time."""
        return {"ratios": list(self.ratios), "before_loss": dict(self._before_loss)}

    def _search_on(self, rec: StepRecord, first: bool) -> None:
        if self.search is None or self.batch_size is None:
            return
        steps = self.planner.taken - self._fit_start  # every step of the fit, the calibration's included
        if not self.search.settled and steps >= self._settle_by:
            before = list(self.ratios)
            for event in self.search.time_up(steps):
                self.events.append(event)
                self.advice.event(event)
            self.ratios = list(self.search.ratios)
            self._changed = self._changed or self.ratios != before
            self._window = StepsWindow()
            return
        if list(rec.samples) != self.search.shares():
            self._window = StepsWindow()  # a ragged step, or one run at other shares
            return
        if first:  # (:meth:`SizesRun.first_use`) probing such a size again is free
            return
        w = self._window
        w.add(rec)
        factor = self.search.window_factor()
        if w.steps < WINDOW_STEPS * factor or w.seconds < WINDOW_SECONDS * factor:
            return
        self._window = StepsWindow()
        window = w.window(tuple(self.search.ratios))
        before = list(self.ratios)
        events = self.search.observe(window)
        self.speeds = window.speeds() or self.speeds
        self.ratios = list(self.search.ratios)
        for event in events:
            self.events.append(event)
            self.advice.event(event)
        if self.ratios != before:
            self._changed = True
        search = self.search
        settled = search is not None and search.settled and search.shares(window.ratios) == search.shares()
        self.advice.gain(window, settled, self.solo_speeds, self.batch_size or 0)

    def end_epoch(self, epoch: int) -> dict:
        """The epoch's per-device breakdown (from the shared records); saves the profile if shares moved."""
        e, steady = self.tally.totals, self.tally.steady()
        total = sum(self.ratios)
        self.last_report = {"epoch": epoch, "devices": self.tally.rows(
            [d.label for d in self.devices], [r / total for r in self.ratios],
            [self.cap_of(r) for r in range(self.world_size)])}
        self.tally.reset()
        if self.options.report and e["steps"]:
            self._log(format_report(self.last_report).removeprefix("multigpu: "))
        self.advice.epoch(epoch, e)
        self.parking.judge(steady, None if self.lost else 0, self.solo_speeds)  # (after a loss: no judgment)
        if self._changed and self.options.auto and not self.lost:
            self._save_profile()
        return self.last_report

    def _save_profile(self) -> None:
        self._changed = False
        if self.rank != 0 or not self.speeds:
            return
        path = self._profile_path()
        # The shares the search keeps, never one it is trying: the next run starts where this one stood.
        ratios = list(self.search.base) if self.search is not None else list(self.ratios)
        entry = {"devices": [d.spec for d in self.devices], "speeds": list(self.speeds), "ratios": ratios,
                 "batch_size": self.batch_size, "measured": time.time(), "pid": os.getpid()}
        try:
            write_profile(path, self._key(), entry)
        except OSError as exc:
            warnings.warn(f"multigpu: could not write the profile {path}: {exc}", stacklevel=2)
