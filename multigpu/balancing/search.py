"""The search for the best shares, judged by measured throughput (pure Python).

Each device's in-run compute speed says which device the others wait for,
but not how fast the run goes: devices that share caches, memory bandwidth,
a PCIe switch or a power budget slow each other down, a throttled device runs
in bursts, and communication competes with compute.  So the speeds only
*propose* a move; the global samples/s measured after the move *judge* it:

* a move that pays is kept, and the next one goes further the same way;
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
* once settled, the search watches: a drop of the throughput at the kept
  shares below the mean of its recent windows (well beyond the measured
  noise), or a large imbalance of the compute speeds, starts it again, first
  with a jump to the shares the speeds call for (a device that slowed down
  mid-run), judged like any move.

Every rank feeds the same all-reduced windows to its own :class:`ShareSearch`,
so all ranks take the same decisions without another collective.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from multigpu.planning.shares import capped_split, predicted_step_time

__all__ = ["Event", "ShareSearch", "Window", "balance_efficiency"]


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
    """

    ratios: tuple[float, ...]
    samples: int
    seconds: float
    compute: tuple[float, ...]
    local: tuple[int, ...]

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
        kind: ``"probe"`` (trying ``after``), ``"jump"`` (trying the shares the
            compute speeds call for), ``"keep"``, ``"undo"``, ``"settle"``,
            ``"restart"``, ``"rebase"`` (the kept shares were measured anew).
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


def _normalize(ratios: Sequence[float]) -> tuple[float, ...]:
    total = float(sum(ratios))
    return tuple(float(r) / total for r in ratios)


@dataclass
class ShareSearch:
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
        patience: the search settles after this many undone moves in a row.
    """

    ratios: Sequence[float]
    batch_size: int
    caps: Sequence[int | None] | None = None
    first_step: float = 0.04
    noise_floor: float = 0.005
    max_step: float = 0.2
    min_step: float = 0.0
    patience: int = 4
    base: tuple[float, ...] = field(init=False)
    step: float = field(init=False)
    settled: bool = field(default=False, init=False)
    changes: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.ratios = _normalize(self.ratios)
        self.base = tuple(self.ratios)
        self.step = self.first_step
        self._base_runs: list[float] = []  # throughput of recent windows at `base`
        self._noise: list[float] = []  # relative differences of successive windows at the same shares
        self._trial: tuple[tuple[float, ...], str, tuple[int, int] | None] | None = None
        self._tried: set[tuple[int, int]] = set()
        self._momentum: tuple[int, int] | None = None
        self._reference = 0.0  # throughput when the search settled
        self._alarms = 0
        self._speeds: list[float] | None = None
        self._jumped = False  # one jump per search: after it, local moves only
        self._trial_runs: list[float] = []
        self._imbalance = 1.0
        self._undone = 0  # undone moves since the last kept one
        self._watched: list[float] = []  # recent windows at the settled shares

    # ------------------------------------------------------------ helpers
    def shares(self, ratios: Sequence[float] | None = None) -> list[int]:
        """Integer rows per device of a full global batch."""
        return capped_split(self.batch_size, ratios if ratios is not None else self.ratios, self.caps)

    def noise(self) -> float:
        """Relative noise of one window's throughput: an estimate of its standard deviation.

        The median of the successive windows' absolute differences, over sqrt 2 (a difference
        of two windows is sqrt 2 as noisy as one), over 0.6745 (the median of ``|N(0, 1)|``):
        robust to the odd outlier window, and a standard deviation, so that "3 x noise" means
        three standard deviations.
        """
        if len(self._noise) < 2:
            return 0.015  # until measured: a quiet machine
        return statistics.median(self._noise[-10:]) / math.sqrt(2) / 0.6745

    def window_factor(self) -> int:
        """How many standard windows the next measurement should last.

        Noisy measurements (a busy machine, a device throttled in bursts) are
        averaged over longer windows: the noise of a mean falls with the
        square root of its length, so a window ``k`` times longer brings a
        noise ``n`` down to ``n / sqrt(k)``; the target is 1.5%.
        """
        return int(min(8, max(1, round((self.noise() / 0.015) ** 2))))

    def _margin(self) -> float:
        return max(self.noise_floor, 0.5 * self.noise())

    def _base_throughput(self) -> float:
        return statistics.fmean(self._base_runs[-3:]) if self._base_runs else 0.0

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
        """From the compute speeds: the move they suggest, the shares they call for, the imbalance."""
        if self._speeds is None:
            return None, None, 1.0
        speeds = self._speeds
        now = self.shares(self.base)
        load = [b / s for b, s in zip(now, speeds)]
        src = max(range(len(load)), key=lambda r: (load[r], -r))
        dst = min(range(len(load)), key=lambda r: (load[r], r))
        proposal = _normalize(speeds)
        best = predicted_step_time(self.shares(proposal), speeds)
        imbalance = predicted_step_time(now, speeds) / best if best > 0 else 1.0
        return ((src, dst) if src != dst else None), proposal, imbalance

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
        throughput = window.throughput
        if self._trial is not None:
            return self._judge(throughput)
        if not self.settled and self._base_runs and self._shifted(throughput):
            return self._rebase(throughput)
        if self._base_runs:
            last = self._base_runs[-1]
            self._noise.append(abs(throughput - last) / max((throughput + last) / 2, 1e-12))
        self._base_runs = [*self._base_runs[-2:], throughput]
        if self.settled:
            return self._watch(throughput)
        if len(self._base_runs) < 2 and not self._noise:
            return []  # two windows first: one to warm up, one to compare
        return self._propose()

    def _shifted(self, throughput: float) -> bool:
        """True when the kept shares now run far from what they ran before (the devices changed speed)."""
        before = self._base_throughput()
        return abs(throughput - before) > before * max(0.08, 4 * self.noise())

    def _rebase(self, throughput: float) -> list[Event]:
        """The kept shares run far from before: later moves are judged against the new figure.

        Either a device changed speed during the search (then the compute
        speeds are out of balance and the search may jump to the shares they
        call for, judged like any move), or the machine is noisy (then only the
        figure is renewed: the search goes on where it was).
        """
        before = self._base_throughput()
        self._base_runs = [throughput]
        self._jumped = False
        why = "throughput at the kept shares " + ("fell" if throughput < before else "rose")
        return [Event("rebase", tuple(self.ratios), tuple(self.ratios), before, throughput, why), *self._propose()]

    def _propose(self) -> list[Event]:
        pair, proposal, imbalance = self._model()
        if proposal is not None and not self._jumped and imbalance > 1.0 + max(0.1, 3 * self.noise()):
            self._jumped = True
            if self.shares(proposal) != self.shares(self.base):
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
        return [Event(kind, before, trial, self._base_throughput(), 0.0, reason)]

    def _judge(self, throughput: float) -> list[Event]:
        trial, _, pair = self._trial  # type: ignore[misc]
        before = self._base_throughput()
        self._trial_runs.append(throughput)
        measured = statistics.fmean(self._trial_runs)
        margin = self._margin() / math.sqrt(len(self._trial_runs))
        if measured > before * (1 + margin) and len(self._trial_runs) < 2:
            return []  # looks better: one more window to confirm before keeping it
        self._trial = None
        runs, self._trial_runs = self._trial_runs, []
        throughput = measured
        if measured > before * (1 + margin):
            old = self.base
            self.base = trial
            self._base_runs = runs
            self.changes += 1
            self._undone = 0
            self._tried.clear()
            if pair is not None:
                self._momentum = pair
                self._tried.add((pair[1], pair[0]))  # back is where we came from
                self.step = min(self.step * 1.5, self.max_step)
            else:
                self._momentum = None
                self.step = self.first_step
            return [Event("keep", old, trial, before, throughput, f"{throughput / before - 1:+.1%}")]
        self.ratios = self.base
        self._undone += 1
        if pair is not None:
            self._tried.add(pair)
            if pair == self._momentum:
                self._momentum = None
        undo = Event("undo", trial, self.base, before, throughput, f"{throughput / before - 1:+.1%}")
        if self._undone >= self.patience:
            return [undo, *self._settle(f"{self._undone} moves in a row did not pay")]
        return [undo]

    def _settle(self, why: str = "no move of one sample or more pays") -> list[Event]:
        self.settled = True
        self._reference = self._base_throughput()
        self._watched = [self._reference]
        self._imbalance = self._model()[2]  # what the speeds say at the best shares: their bias, not a change
        self._alarms = 0
        self._undone = 0
        return [Event("settle", tuple(self.ratios), tuple(self.ratios), self._reference, 0.0, why)]

    def _watch(self, throughput: float) -> list[Event]:
        _, proposal, imbalance = self._model()
        dropped = throughput < self._reference * (1 - max(0.05, 3 * self.noise()))
        skewed = proposal is not None and imbalance > self._imbalance * (1.0 + max(0.15, 4 * self.noise()))
        self._alarms = self._alarms + 1 if (dropped or skewed) else 0
        if self._alarms < 2:
            if not dropped:  # the reference is the mean of recent windows: the max of noisy ones would be too high
                self._watched = [*self._watched[-4:], throughput]
                self._reference = statistics.fmean(self._watched)
            return []
        self.settled = False
        self.step = self.first_step
        self._tried.clear()
        self._momentum = None
        self._jumped = False
        self._base_runs = self._base_runs[-1:]
        why = "throughput fell" if dropped else f"compute speeds {imbalance:.2f}x out of balance"
        events = [Event("restart", tuple(self.ratios), tuple(self.ratios), self._reference, throughput, why)]
        return events + self._propose()
