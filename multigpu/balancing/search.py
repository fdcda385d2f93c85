"""The search for the best shares, judged by measured throughput (pure Python).

Each device's in-run compute speed says which device the others wait for,
but not how fast the run goes: devices that share caches, memory bandwidth,
a PCIe switch or a power budget slow each other down, a throttled device runs
in bursts, and communication competes with compute.  So the speeds only
*propose* a move; the global samples/s measured after the move *judge* it:

* first a scan (:mod:`multigpu.balancing.scan`): one window each at the
  shares the speeds call for and at a few moves of 10% and 25% of the batch
  both ways; the best, if it beats the start, is measured again like any move;
* the speeds are fitted per device as a fixed cost per step plus a cost per
  row once the measured shares allow it (:class:`StepCosts`): where the fixed
  part is large, the best shares give the slow device fewer rows than its
  speed says;
* a move that pays is kept only after the kept shares are measured once
  more (A, B, A): it must beat the median of their last windows, this one
  included, so that one low window at the kept shares (a burst of the
  machine's own work) cannot keep a worse move; then the next move goes
  further the same way;
* a move that does not pay is undone; when both ways have failed at a step
  size the step is halved, until it is below one sample, or below
  ``min_step`` where each new local batch size costs a compilation (JAX):
  the search settles.  It also settles after ``patience`` moves in a row
  were undone: each probe runs a window at worse shares, and on a noisy
  machine a long run of failed probes costs more than the small moves left
  could find;
* while searching, the kept shares are measured again between moves; when
  they run far from before (a device changed speed mid-search, and every
  move would be judged against a stale figure) moves are judged against the
  new figure, and a jump to the shares the speeds call for may be tried again;
* when it settles where throughput could not tell the kept shares from
  moves toward the compute speeds' balance, it settles nearest that balance
  (:mod:`multigpu.balancing.settling`);
* once settled, the search stays settled and probes nothing until the
  throughput at the kept shares falls well beyond its noise
  (:mod:`multigpu.balancing.watch`); then it starts again, first with a jump
  to the shares the speeds call for (a device that slowed down mid-run).

Every rank feeds the same all-reduced windows to its own :class:`ShareSearch`,
so all ranks take the same decisions without another collective.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from multigpu.balancing.costs import StepCosts, suggest
from multigpu.balancing.figures import Figures
from multigpu.balancing.scan import Scan
from multigpu.balancing.settling import Settling
from multigpu.balancing.tuning import Tuning
from multigpu.balancing.watch import Watch
from multigpu.balancing.windows import Event, Window, balance_efficiency, normalize
from multigpu.planning.shares import capped_split

__all__ = ["Event", "ShareSearch", "StepCosts", "Tuning", "Window", "balance_efficiency"]


@dataclass
class ShareSearch(Settling):
    """Finds the shares with the highest measured throughput, and keeps them.

    Args:
        ratios: the starting shares (from calibration or a profile).
        batch_size: the global batch (moves smaller than one sample are not tried).
        caps: optional per-device largest local batch.
        first_step: the first move, as a fraction of the batch.
        noise_floor: the smallest relative gain that counts as a gain.
        max_step: the largest move, as a fraction of the batch.
        min_step: the smallest move, as a fraction of the batch (and never
            below one sample); the search settles when halving would go below.
        quantum: local batch sizes are multiples of this many rows (see
            :func:`~multigpu.planning.shares.capped_split`).
        off_grid: settled, the search may take the speeds' balance between two sizes of that grid
            (:meth:`~multigpu.balancing.settling.Settling._off_grid`).
        patience: the search settles after this many undone moves in a row.
        fixed_costs: model each device's step as a fixed part plus a part per
            row once the windows allow it (:class:`StepCosts`).
        scan: at the start, before moving step by step, one window each at the
            shares the speeds call for and at moves of these fractions of the
            batch both ways between the two devices the speeds point at; the
            best of them, if it beats the start, is measured again and kept if
            it pays.  Throughput is not always a single hill: a throttled device
            that gets few rows can run them within its bursts, and a step by
            step search stops on the plateau before.  ``()`` skips it (JAX,
            where every new local batch size compiles).
        tuning: the thresholds (:class:`Tuning`).
    """

    ratios: Sequence[float]
    batch_size: int
    caps: Sequence[int | None] | None = None
    first_step: float = 0.04
    noise_floor: float = 0.005
    max_step: float = 0.2
    min_step: float = 0.0
    quantum: int = 1
    off_grid: bool = False
    patience: int = 4
    fixed_costs: bool = True
    scan: tuple[float, ...] = (0.1, 0.25)
    tuning: Tuning = field(default_factory=Tuning)
    base: tuple[float, ...] = field(init=False)
    step: float = field(init=False)
    settled: bool = field(default=False, init=False)
    changes: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.ratios = normalize(self.ratios)
        self.base = tuple(self.ratios)
        self.grid = self.quantum  # the sizes' grid while searching (settled, the speeds' balance may be off it)
        self.step = self.first_step
        self.figures = Figures(self.tuning, self.noise_floor)  # the kept shares' windows, the noise
        self._trial: tuple[tuple[float, ...], str, tuple[int, int] | None] | None = None
        self._tried: set[tuple[int, int]] = set()
        self._momentum: tuple[int, int] | None = None
        self.watch = Watch(self.tuning)  # the settled shares' throughput
        self._speeds: list[float] | None = None
        self._trial_runs: list[float] = []
        self._undone = 0  # undone moves since the last kept one
        self._costs = StepCosts(self.batch_size)
        self._window: Window | None = None  # the last window observed
        self._scan = Scan(tuple(self.scan))
        self._strict = False  # the trial is the best of the scan
        self._jumps: set[tuple[int, ...]] = set()  # where this search has jumped to
        self._judged: list[tuple[tuple[float, ...], float, int]] = []  # moves undone since the last kept one
        self._confirm: tuple[tuple[float, ...], tuple[int, int] | None, list[float], float] | None = None  # _confirmed
        self._kept_imbalance: float | None = None  # the compute times' imbalance at the kept shares' last window

    @property
    def phase(self) -> str:
        """``"scanning"`` (the opening scan), ``"searching"`` (moves judged one by one) or ``"settled"`` (watching)."""
        if self.settled:
            return "settled"
        if self._scan.queue or (self._trial is not None and self._trial[1] == "scan"):
            return "scanning"
        return "searching"

    # ------------------------------------------------------------ helpers
    def shares(self, ratios: Sequence[float] | None = None) -> list[int]:
        """Integer rows per device of a full global batch."""
        return capped_split(self.batch_size, ratios if ratios is not None else self.ratios, self.caps, self.quantum)

    def noise(self) -> float:
        """Relative noise of one window's throughput (a standard deviation; :meth:`Figures.noise`)."""
        return self.figures.noise()

    def window_factor(self) -> int:
        """How many standard windows the next measurement should last (:meth:`Figures.window_factor`).

        The scan's points take one standard window each: it looks for differences of 10% and more, and the
        best is measured again with full windows.
        """
        if self._trial is not None and self._trial[1] == "scan":
            return 1
        return self.figures.window_factor()

    def _moved(self, pair: tuple[int, int], amount: float) -> tuple[float, ...] | None:
        """``base`` with ``amount`` of the batch moved from device ``pair[0]`` to ``pair[1]``."""
        src, dst = pair
        new = list(self.base)
        amount = min(amount, new[src] - 0.5 / self.batch_size)
        if amount <= 0:
            return None
        new[src] -= amount
        new[dst] += amount
        new_t = tuple(new)
        return new_t if self.shares(new_t) != self.shares(self.base) else None

    def _model(self) -> tuple[tuple[int, int] | None, tuple[float, ...] | None, float]:
        """From the compute times: the move they suggest, the shares they call for, the imbalance.

        Once the windows span enough shares, each device's time is fitted as a
        fixed part plus a part per row (:class:`StepCosts`); until then the
        compute speeds are taken as proportional.
        """
        if self._speeds is None:
            return None, None, 1.0
        fitted = self._costs.fit() if self.fixed_costs else None
        return suggest(self.shares(self.base), self._speeds, fitted, self._costs, self.shares, self._jitter())

    def _jitter(self) -> tuple[float, ...]:  # each device's step-to-step deviation in the last window, as its speeds
        return self._window.jitter if self._window is not None else ()

    # ---------------------------------------------------------- decisions
    def observe(self, window: Window) -> list[Event]:
        """Feeds one window; returns what was decided (``self.ratios`` may change).

        A window measured at other shares than the current ones (the steps
        around a move) is ignored.
        """
        if window.seconds <= 0 or self.shares(window.ratios) != self.shares(self.ratios):
            return []
        speeds = window.speeds()
        if speeds is not None:
            self._speeds = speeds
        self._window = window
        throughput = window.throughput
        if self._trial is not None:
            self._costs.add(window)
            return self._judge(throughput)
        if self._confirm is not None:
            return self._confirmed(throughput)
        if not self.settled and self.figures.runs and self._shifted(throughput):
            return self._rebase(throughput)
        if speeds is not None:
            self._costs.add(window)
        self._kept_imbalance = _imbalance(window)
        self.figures.add(throughput)
        if self.settled:
            return self._watch(throughput)
        if len(self.figures.runs) < 2 and (not self.figures.differences or self._scan.results):
            return []  # two windows first (at the start, and after the scan)
        return self._propose()

    def _shifted(self, throughput: float) -> bool:
        """True when the kept shares now run far from what they ran before (the devices changed speed)."""
        before = self.figures.kept()
        return abs(throughput - before) > before * max(self.tuning.shift, self.tuning.shift_noise * self.noise())

    def _rebase(self, throughput: float) -> list[Event]:
        """The kept shares run far from before: later moves are judged against the new figure.

        Either a device changed speed during the search (then the compute
        speeds are out of balance and the search may jump to the shares they
        call for, judged like any move), or the machine is noisy (then only the
        figure is renewed: the search goes on where it was).
        """
        before = self.figures.kept()
        self.figures.runs = [throughput]
        self._judged = []  # judged against the old figure
        self._jumps.clear()
        if not self._costs.describes(self._window):
            self._costs.clear()  # a device changed speed: the fit describes devices that are gone
        self._costs.add(self._window)
        why = "throughput at the kept shares " + ("fell" if throughput < before else "rose")
        return [Event("rebase", tuple(self.ratios), tuple(self.ratios), before, throughput, why), *self._propose()]

    def _propose(self) -> list[Event]:
        pair, proposal, imbalance = self._model()
        scan = self._scan
        if not scan.opened:
            scan.open(self.base, proposal, pair, self._moved, self.shares)
            if proposal is not None and tuple(proposal) in scan.queue:
                self._jumps.add(tuple(self.shares(proposal)))  # measured by the scan: no jump there later
        if scan.queue:
            return self._start(scan.queue.pop(0), "scan", None, "")
        found = scan.best()
        if found is not None:
            rate, best = found
            if rate > self.figures.kept() * (1 + self.figures.margin()):
                self._strict = True  # the best of several noisy windows: kept on a stricter test
                return self._start(best, "jump", None, f"the best of the scan ({rate:.0f} samples/s)")
        # At most two jumps per search (from the speeds, then from the fitted costs), never twice to one place.
        target = tuple(self.shares(proposal)) if proposal is not None else None
        t = self.tuning
        if (target is not None and target not in self._jumps and len(self._jumps) < t.max_jumps
                and imbalance > 1.0 + max(t.jump_imbalance, t.jump_noise * self.noise())):
            self._jumps.add(target)
            if list(target) != self.shares(self.base):
                return self._start(proposal, "jump", None, f"compute speeds {imbalance:.2f}x out of balance")
        while self.step * self.batch_size >= max(1.0, self.min_step * self.batch_size):
            candidates = []
            if self._momentum is not None:
                candidates.append(self._momentum)
            if pair is not None:
                candidates += [pair, (pair[1], pair[0])]
            n = len(self.base)
            if pair is not None:  # more devices: off the bottleneck, to each of the others
                candidates += [(pair[0], b) for b in range(n) if b != pair[0]]
            else:
                candidates += [(a, b) for a in range(n) for b in range(n) if a != b]
            for cand in dict.fromkeys(candidates):
                if cand in self._tried:
                    continue
                trial = self._moved(cand, self.step)
                if trial is None:
                    self._tried.add(cand)
                    continue
                return self._start(trial, "probe", cand, "")
            self.step /= 2
            self._tried.clear()
            self._momentum = None
        return self._settle()

    def _start(self, trial, kind: str, pair, reason: str) -> list[Event]:
        self._trial = (trial, kind, pair)
        self._trial_runs = []
        before = tuple(self.ratios)
        self.ratios = trial
        return [Event(kind, before, trial, self.figures.kept(), 0.0, reason)]

    def _judge(self, throughput: float) -> list[Event]:
        trial, kind, pair = self._trial  # type: ignore[misc]
        before = self.figures.kept()
        if kind == "scan":  # one window, then the next point: the best is judged like any move at the end
            self._trial = None
            self._scan.results.append((throughput, trial))
            self.ratios = self.base
            event = Event("scanned", trial, self.base, before, throughput, f"{throughput / before - 1:+.1%}")
            if self._scan.queue:
                return [event, *self._propose()]
            # The start's figure is from before the scan, when the run was colder: measure it again first,
            # over two windows (their difference is also a measure of the noise, which the decision needs).
            self.figures.runs = []
            return [event]
        self._trial_runs.append(throughput)
        measured = statistics.fmean(self._trial_runs)
        strictness = (self.tuning.strict_factor if self._strict else 1.0) * self._away_factor()
        margin = self.figures.margin(len(self._trial_runs), strictness)
        if measured > before * (1 + margin) and len(self._trial_runs) < 2:
            return []  # looks better: one more window to confirm before keeping it
        self._trial = None
        self._strict = False
        runs, self._trial_runs = self._trial_runs, []
        self.ratios = self.base
        if measured > before * (1 + margin):
            # Looks better: the kept shares are measured once more before the move is kept.
            self._confirm = (trial, pair, runs, strictness)
            return [Event("recheck", trial, self.base, before, measured, f"{measured / before - 1:+.1%}")]
        return self._undo(trial, pair, before, measured, len(runs))

    def _away_factor(self) -> float:
        """How many margins a move must win by: ``strict_factor`` where its windows leave the devices' compute
        times further out of balance than the kept shares' (beyond ``away_imbalance``), else 1.

        The compute times compare the devices within the same steps, so a drift of the whole machine does not
        move them; throughput compares windows taken at different times, and a machine that speeds up during
        a move makes it look better.  A move away from the balance is kept only on the stronger evidence.
        """
        now = _imbalance(self._window) if self._window is not None else None
        kept = self._kept_imbalance
        if now is None or kept is None:
            return 1.0
        return self.tuning.strict_factor if now > max(kept, 1.0 + self.tuning.away_imbalance) else 1.0

    def _confirmed(self, throughput: float) -> list[Event]:
        """The kept shares measured again after a move looked better: the move is kept only if it still beats them.

        Their figure is now the median of their last three windows, this one included (the mean of two when
        there are only two): a low window among them, or a machine that ran faster during the move than
        before it, no longer keeps a move that does not pay.
        """
        trial, pair, runs, strictness = self._confirm  # type: ignore[misc]
        self._confirm = None
        if self._window is not None:
            self._kept_imbalance = _imbalance(self._window)
        self.figures.add(throughput)
        before = self.figures.robust()
        measured = statistics.fmean(runs)
        margin = self.figures.margin(len(runs), strictness)
        # Either way the next move can start now: the move's windows are its figure, and the kept shares were
        # just measured.
        if measured > before * (1 + margin):
            return [*self._keep(trial, pair, runs, before, measured), *self._propose()]
        events = self._undo(trial, pair, before, measured, len(runs))
        return events if self.settled else events + self._propose()

    def _keep(self, trial, pair, runs: list[float], before: float, throughput: float) -> list[Event]:
        old = self.base
        self.base = trial
        self.ratios = trial
        self.figures.runs = runs
        self.changes += 1
        self._undone = 0
        self._judged = []
        self._tried.clear()
        if pair is not None:
            self._momentum = pair
            self._tried.add((pair[1], pair[0]))  # back is where we came from
            self.step = min(self.step * self.tuning.growth, self.max_step)
        else:
            self._momentum = None
            self.step = self.first_step
        return [Event("keep", old, trial, before, throughput, f"{throughput / before - 1:+.1%}")]

    def _undo(self, trial, pair, before: float, throughput: float, windows: int = 1) -> list[Event]:
        self.ratios = self.base
        self._undone += 1
        if before > 0:
            self._judged.append((tuple(trial), throughput / before - 1, windows))
        if pair is not None:
            self._tried.add(pair)
            if pair == self._momentum:
                self._momentum = None
        undo = Event("undo", trial, self.base, before, throughput, f"{throughput / before - 1:+.1%}")
        if self._undone >= self.patience:
            return [undo, *self._settle(f"{self._undone} moves in a row did not pay")]
        return [undo]


def _imbalance(window: Window) -> float | None:
    """The slowest device's compute time over the fastest's in ``window`` (devices with rows), or None."""
    times = [t for t, n in zip(window.compute, window.local) if n > 0]
    if len(times) < 2 or min(times) <= 0:
        return None
    return max(times) / min(times)
