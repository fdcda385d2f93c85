"""Setting aside the devices that do not pay: the judgment (automatic shares only; the steps do the moves).

When the first device (the leader) alone, or a group of the devices without
the rest, computes faster than all the devices together run (the sums and the
waits cost more than the others add: a small model, a slow link, a device far
slower than the rest), the others are set aside: from the next epoch they get
no rows and leave the step's sum, which on one device left is no sum at all
and on several a sum among them; they stay in the run and in every
collective outside the training steps (validation, saves, the epoch's
metrics), and take the current weights and optimizer state when they come
back.  The judgment is the same on every rank (it reads the shared step
records), so every rank moves at the same epoch boundary.

* **Judged**: at the end of a fit's epochs, from the second on (:data:`EPOCHS`),
  by what the leader's device would run alone (:meth:`Parking.alone_estimate`:
  its steps' time outside collectives, split into fixed work and its rows at
  its calibrated speed, the rows grown to the whole batch) against the best
  throughput the devices ran together in an epoch of this fit (its rows over
  its wall time, without the steps that paid a new local batch size's first
  use: a trace or a compilation can last as long as twenty steps, and the
  search's moves make them in the epochs judged;
  :meth:`~multigpu.balancing.tally.EpochTally.steady`): with :data:`MARGIN` to
  spare, the others are set aside.  The
  fixed work measured together may hold costs a step alone does not pay (the
  host round trip of TensorFlow's sum), so the estimate is a floor; its ceiling
  is the rows alone at the device's speed, with no fixed work
  (:meth:`Parking.alone_ceiling`), itself low where a step's fixed work is
  paid per pass at the device's share (a pass of 32 rows costs more per row
  than one of 64).  Where the floor does not clear the margin but the ceiling
  reaches :data:`TRIAL_REACH` of the together figure, the others are set aside
  to try: only a measurement alone tells.  Where even the ceiling falls
  short, every device is kept.  The device judged is the one that would compute fastest
  alone (:meth:`Parking.keeper`): the leader (rank 0 while no rank was lost)
  unless another's estimate beats the leader's by :data:`MARGIN` (two equal
  devices: the leader, whichever measured a little faster), so a slow device
  listed first is set aside as a slow one listed last is.  While the leader is
  set aside, the device left sends it its weights at every epoch's end and its
  whole state before a save (the leader's callbacks read and save what was
  trained: :mod:`multigpu.backend.parking`).
  With three devices or more, where the steps can sum over part of the ranks
  (``groups``: not JAX's XLA sums), every group of more than one device is
  estimated too (:meth:`Parking.group_estimate`: each keeps its fixed work and
  speed a row, the rows go where the devices finish together, the sum costs
  what it cost them all); the best group is kept where it beats the devices
  together by :data:`MARGIN` and the estimate of the device judged alone
  (no trial for a group: its fixed work, sums included, was measured
  together).
* **Tried**: while set aside, the devices left measure their throughput
  without them (their first step at the whole batch, its first use, left out);
  at the epoch's end they keep the others aside when they ran at least as fast
  as they ran together, else they come back, and this ``fit`` does not set
  them aside again (a trial that lost costs one epoch at the device's speed
  alone, which its ceiling put near the together figure).
* **Measured again**: after :data:`REMEASURE` epochs aside in a ``fit`` the
  devices set aside come back for one epoch, which is judged as the first
  ones were (the devices together measured anew: a device that was busy or a
  link that was slow may pay now); set aside again, they stay twice as long
  before the next measurement (the cost of the epochs together halves each
  time).
* **Back**: at every ``fit``'s end (the next ``fit`` judges again, at its
  batch), or when the trial lost.

``MULTIGPU_PARK=force`` (a testing aid, never set in a real run) sets the
devices but the leader aside after a fit's first epoch and keeps them aside
(``force:R``: every device but rank ``R``'s);
``MULTIGPU_PARK=off`` (for benchmarks) never sets one aside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from multigpu import env
from multigpu.balancing.timing import StepRecord

__all__ = ["EPOCHS", "MARGIN", "REMEASURE", "TRIAL_REACH", "Parking"]

MARGIN = 1.1  # the device left alone must compute this much faster than the devices ran together
EPOCHS = 2  # epochs of a fit judged: the first one's steps hold its start-up (new sizes, the search's first moves)
REMEASURE = 8  # epochs aside before the devices set aside are measured again (then twice as many each time)
# A trial alone where the ceiling reaches this fraction of the devices together: on JAX's MLP at batch 64 (shares of
# 32 rows, sums through shared memory) the ceiling read 14,000 to 18,000 samples/s where one core ran 20,400 to
# 25,100 alone and the two devices together 15,400 to 17,900 (0.91 to 1.0 of them): the ceiling read 0.6 to 0.8 of
# the device alone. On the demo's convnet (passes of 343 rows) it read what the device ran alone, 0.85 of the two
# together in one run: a trial at 0.75 lost an epoch there. A trial that loses costs one epoch at the ceiling's
# speed at least, a tenth below the devices together at most.
TRIAL_REACH = 0.9


class Parking:
    """Which devices are set aside, and when they move (the same on every rank).

    Args:
        devices: every rank's device (``label`` is used).
        log: prints one line (rank 0 only).
    """

    def __init__(self, devices: Sequence, log: Callable[[str], None]) -> None:
        self.devices = list(devices)
        self._log = log
        self.allowed = False  # automatic shares on steps that can leave ranks out of the sum (set by the steps)
        self.groups = False  # and sum over part of the ranks: more than one device may be left (set by the steps)
        park = env.get(env.PARK) or ""
        keepers = park.removeprefix("force:").split(",") if park.startswith("force:") else None
        if park not in ("", "force", "off") and not (
                keepers and all(k.isdigit() and int(k) < len(devices) for k in keepers)
                and len(set(keepers)) == len(keepers) < len(devices)):
            raise ValueError(f"{env.PARK} (a testing aid) must be 'force', 'force:R' or 'force:R,S,...' with R, S, "
                             f"... distinct ranks of this run (0 to {len(devices) - 1}), not all of them, or 'off'. "
                             f"Received: {env.PARK}={park!r}")
        self.forced = park == "force" or keepers is not None
        self.forced_keepers = sorted(int(k) for k in keepers) if keepers is not None else None
        self.never = park == "off"
        self.due: list[int] = []  # ranks to set aside at the next epoch's start
        self.parked: list[int] = []  # ranks set aside now
        self.kept: int | None = None  # the rank left (of several, the first): judged, then while the others are aside
        self.left: list[int] = []  # every rank left (judged, then while the others are aside)
        self.kept_ratios: list[float] | None = None  # the shares before, given back with the devices
        self.tried = False  # this fit set devices aside once already
        self.together = 0.0  # the best throughput of the devices together in this fit
        self.alone_speed = 0.0  # the device left's compute speed at its share, when judged
        self.judgment: dict | None = None  # the last judgment's figures (:meth:`verdict`), and what came of it
        self._epochs = 0
        self._alone = [0, 0.0]  # samples and seconds of the steps alone
        self._aside_epochs = 0  # epochs ended with the devices set aside, since they were last set aside
        self.period = REMEASURE  # epochs aside before they are measured again (doubles each time, per fit)

    def begin_fit(self) -> None:
        """A new ``fit``: every device in again (:meth:`back` ran at the last one's end), judged anew."""
        self.due, self.tried, self.together, self._epochs = [], False, 0.0, 0
        self.period = REMEASURE

    # ------------------------------------------------------------- the judgment
    def judge(self, e: dict, leader: int | None, solo: Sequence[float] | None = None) -> None:
        """An epoch of the devices together ended: its totals ``e`` (:class:`~multigpu.balancing.tally.EpochTally`,
        the same on every rank; ``leader`` None: a rank was lost, no judgment; ``solo``: calibration's speeds)."""
        if (not self.allowed or self.never or self.parked or self.due or self.tried or leader is None
                or not e.get("steps")):
            return
        self._epochs += 1
        n = len(e["samples"])
        wall = max(e["wall"])
        self.together = max(self.together, sum(e["samples"]) / wall if wall > 0 else 0.0)
        if self.forced:
            self._keep([leader] if self.forced_keepers is None else self.forced_keepers, n)
            return
        if self._epochs < EPOCHS:
            return
        left, self.judgment = self.choose(e, leader, solo, self.devices, self.together, self.groups)
        if left:
            self._keep(left, n)
            self.alone_speed = self.judgment["alone"]
            self.judgment["set_aside"] = [self.devices[r].label for r in self.due]

    @classmethod
    def choose(cls, e: dict, leader: int, solo: Sequence[float] | None, devices: Sequence,
               together: float | None = None, groups: bool = False) -> tuple[list[int], dict]:
        """The ranks to keep at an epoch's totals ``e`` (none: every device pays) and the judgment's figures
        (:meth:`verdict`; where a group of devices is kept, ``devices`` names them and ``alone`` is their
        estimate): the device that would compute fastest alone (:meth:`keeper`), or with ``groups`` (sums over
        part of the ranks) the best group of more than one device (:meth:`best_group`) where it beats the devices
        together by :data:`MARGIN` and that device alone."""
        judgment = cls.verdict(e, cls.keeper(e, leader, solo), solo, devices, together)
        judgment["set_aside"] = []
        group = cls.best_group(e, solo) if groups and len(e["samples"]) > 2 else None
        if group is not None and group[1] >= MARGIN * judgment["together"] and (
                judgment["pays"] or judgment["trial"] or group[1] > judgment["alone"]):
            left, estimate = group
            judgment.update(device=devices[left[0]].label, alone=round(estimate, 1), pays=False, trial=False,
                            ceiling=round(estimate, 1), devices=[devices[r].label for r in left])
            return left, judgment
        if not judgment["pays"]:
            return [cls.keeper(e, leader, solo)], judgment
        return [], judgment

    def _keep(self, left: Sequence[int], n: int) -> None:
        self.left, self.kept = list(left), left[0]
        self.due = [r for r in range(n) if r not in left]

    @classmethod
    def best_group(cls, e: dict, solo: Sequence[float] | None) -> tuple[list[int], float] | None:
        """The ranks of more than one but not every device that would run fastest together at an epoch's
        totals ``e`` (:meth:`group_estimate`), and their estimate; None if no rank's speed was measured."""
        n = len(e["samples"])
        best: tuple[list[int], float] | None = None
        for mask in range(1, (1 << n) - 1):
            ranks = [r for r in range(n) if mask >> r & 1]
            if len(ranks) > 1:
                estimate = cls.group_estimate(e, ranks, solo)
                if estimate > 0 and (best is None or estimate > best[1]):
                    best = (ranks, estimate)
        return best

    @classmethod
    def group_estimate(cls, e: dict, ranks: Sequence[int], solo: Sequence[float] | None) -> float:
        """Samples/s of the devices of ``ranks`` (more than one) on whole batches without the others, from an
        epoch's totals ``e``: each keeps its fixed work and its speed a row (as in :meth:`alone_estimate`), the
        rows go where the devices finish together, and the step's sum costs what it cost every device, at the
        pace of the group's slowest device against the slowest of all (each rank sums its chunk, and all wait
        for all: a device at a tenth of the speed makes the sum ten times as long; a slow link, which the speeds
        do not show, keeps the whole cost)."""
        steps = e["steps"]
        batch = sum(e["samples"]) / steps
        every = [cls._per_row(e, r, solo) for r in range(len(e["samples"]))]
        per_row = {r: every[r] for r in ranks}
        if any(v is None for v in per_row.values()):
            return 0.0
        pace = max(per_row.values()) / max(v for v in every if v is not None)
        fixed = {r: max(0.0, e["compute"][r] - e["samples"][r] * per_row[r]) / steps for r in ranks}
        active = sorted(ranks, key=lambda r: fixed[r])
        while True:  # the time T at which the devices with fixed work below T share the batch
            finish = (batch + sum(fixed[r] / per_row[r] for r in active)) / sum(1.0 / per_row[r] for r in active)
            if finish >= fixed[active[-1]] or len(active) == 1:
                break
            active.pop()
        return batch / (finish + pace * e["sum"] / steps)

    @classmethod
    def keeper(cls, e: dict, leader: int, solo: Sequence[float] | None) -> int:
        """The rank judged alone at an epoch's totals ``e``: the one whose device would compute fastest alone
        (:meth:`alone_estimate`), the ``leader`` unless another's estimate beats its own by :data:`MARGIN`."""
        estimates = [cls.alone_estimate(e, r, solo) for r in range(len(e["samples"]))]
        best = max(range(len(estimates)), key=lambda r: (estimates[r], r == leader))
        return best if estimates[best] >= MARGIN * estimates[leader] else leader

    @classmethod
    def verdict(cls, e: dict, leader: int, solo: Sequence[float] | None, devices: Sequence,
                together: float | None = None) -> dict:
        """Whether the devices pay at an epoch's totals ``e`` with rank ``leader`` kept (:meth:`keeper`):
        ``device`` (``leader``'s), ``alone``
        (its samples/s alone, :meth:`alone_estimate`), ``ceiling`` (:meth:`alone_ceiling`), ``together`` (the
        devices' samples/s, the best of the fit where given), ``pays`` (False: the others are set aside) and
        ``trial`` (they are set aside to try: the estimate does not clear :data:`MARGIN`, its ceiling reaches
        :data:`TRIAL_REACH` of the together figure)."""
        wall = max(e["wall"]) if e.get("wall") else 0.0
        if together is None:
            together = sum(e["samples"]) / wall if wall > 0 else 0.0
        alone, ceiling = cls.alone_estimate(e, leader, solo), cls.alone_ceiling(e, leader, solo)
        sure = alone >= MARGIN * together
        trial = not sure and together > 0 and ceiling >= TRIAL_REACH * together
        return {"device": devices[leader].label, "alone": round(alone, 1), "ceiling": round(ceiling, 1),
                "together": round(together, 1), "pays": not (sure or trial), "trial": trial}

    @staticmethod
    def alone_estimate(e: dict, rank: int, solo: Sequence[float] | None) -> float:
        """Samples/s of ``rank``'s device on whole batches alone, from an epoch's totals ``e``: a step costs
        its fixed work plus its rows at the device's speed alone (``solo``: calibration's forward and backward
        passes, where measured), the fixed work being what its steps took beyond their rows; without ``solo``,
        every second of a step is taken to grow with its rows (a lower bound)."""
        steps, rows, compute = e["steps"], e["samples"][rank], e["compute"][rank]
        batch = sum(e["samples"]) / steps
        per_row = Parking._per_row(e, rank, solo)
        if per_row is None:
            return 0.0
        fixed = max(0.0, compute - rows * per_row) / steps
        return batch / (fixed + batch * per_row)

    @staticmethod
    def alone_ceiling(e: dict, rank: int, solo: Sequence[float] | None) -> float:
        """Samples/s of ``rank``'s device alone were a step its rows only (no fixed work): what a step alone
        could reach at most, at the per-row cost :meth:`alone_estimate` uses."""
        per_row = Parking._per_row(e, rank, solo)
        return 1.0 / per_row if per_row else 0.0

    @staticmethod
    def _per_row(e: dict, rank: int, solo: Sequence[float] | None) -> float | None:
        rows, compute = e["samples"][rank], e["compute"][rank]
        if not rows or compute <= 0:
            return None
        per_row = compute / rows
        if solo and solo[rank] > 0:
            per_row = min(per_row, 1.0 / solo[rank])
        return per_row

    # ------------------------------------------------------------- the moves
    def park(self, ratios: Sequence[float], epoch: int) -> list[float]:
        """Sets the due ranks aside (at an epoch's start, every rank); returns the shares from now on."""
        self.parked, self.due, self.tried = list(self.due), [], True
        self.kept_ratios = list(ratios)
        self._alone = [0, 0.0]
        self._aside_epochs = 0
        out = [0.0 if r in self.parked else float(v) for r, v in enumerate(ratios)]
        left = [r for r in range(len(out)) if r not in self.parked]
        names = ", ".join(self.devices[r].label for r in self.parked)
        first = ", ".join(self.devices[r].label for r in left)
        alone = "alone computes" if len(left) == 1 else "without them would compute"
        if self.forced:
            why = f"{env.PARK}={env.get(env.PARK)}"
        elif self.judgment is not None and self.judgment.get("trial"):
            why = (f"to try {first} alone, which would compute {self.alone_speed:.0f} to "
                   f"{self.judgment['ceiling']:.0f} samples/s (its fixed work alone unknown) where the {len(out)} "
                   f"devices ran {self.together:.0f} together")
        else:
            why = (f"{first} {alone} {self.alone_speed:.0f} samples/s where the {len(out)} "
                   f"devices ran {self.together:.0f} together (the sums and waits cost more than they add)")
        self._log(f"{names} set aside from epoch {epoch + 1}: {why}; back at the next fit(), or at this epoch's end "
                  f"if {'alone' if len(left) == 1 else 'the devices left'} run{'s' if len(left) == 1 else ''} "
                  "slower")
        return out

    def observe(self, rec: StepRecord, first_use: bool = False) -> None:
        """A step of the devices left (on them only: the others do not step); one that paid its local batch
        sizes' first use (the device alone's first step at the whole batch traces or compiles it) is not counted,
        as the devices together are judged without theirs (:meth:`EpochTally.steady`)."""
        if first_use:
            return
        self._alone[0] += sum(rec.samples)
        self._alone[1] += max(rec.wall)

    @property
    def measured(self) -> list:
        """The samples and seconds of the steps alone so far (the rank left's; :meth:`keeps_aside` reads them)."""
        return list(self._alone)

    @measured.setter
    def measured(self, value) -> None:
        self._alone = list(value)

    @property
    def alone(self) -> float:
        """The throughput of the devices left over the steps alone so far (0 before any)."""
        samples, seconds = self._alone
        return samples / seconds if seconds > 0 else 0.0

    def keeps_aside(self) -> bool:
        """At an epoch's end, on the rank left: whether it ran at least as fast as all the devices together."""
        return self.forced or self.alone == 0.0 or self.alone >= self.together

    def remeasure_due(self) -> bool:
        """At the end of an epoch aside that :meth:`keeps_aside` kept (every rank): whether the devices set aside
        have been aside :attr:`period` epochs, and come back to be measured again."""
        self._aside_epochs += 1
        return self._aside_epochs >= self.period

    @property
    def _who(self) -> str:
        return "alone" if len(self.left) == 1 else "the devices left"

    def back(self, epoch: int | None, again: bool = False) -> list[float]:
        """Every device in again (every rank; ``epoch``: the trial lost at its end, None: the fit ended;
        ``again``: to be measured again, :meth:`remeasure_due`); returns the shares from then on."""
        if again:
            names = ", ".join(self.devices[r].label for r in self.parked)
            epochs = f"{self._aside_epochs} epoch" + ("s" if self._aside_epochs != 1 else "")
            self._log(f"{names} back after epoch {epoch + 1} to be measured again: aside {epochs}, {self._who} ran "
                      f"{self.alone:.0f} samples/s where the {len(self.devices)} devices ran {self.together:.0f} "
                      "together before; judged at this epoch's end")
            # The next epoch is judged as the first ones were, on a figure of the devices together taken anew.
            self.tried, self.together, self.period = False, 0.0, 2 * self.period
            if self.judgment is not None:
                self.judgment["set_aside"] = []
        elif epoch is not None:
            names = ", ".join(self.devices[r].label for r in self.parked)
            self._log(f"{names} back after epoch {epoch + 1}: {self._who} ran {self.alone:.0f} samples/s, less than "
                      f"the {self.together:.0f} together")
            if self.judgment is not None:  # measured: together is faster
                self.judgment.update(set_aside=[], alone_ran=round(self.alone, 1), pays=True)
        self.parked, self.kept, self.left = [], None, []
        ratios, self.kept_ratios = self.kept_ratios or [], None
        return ratios
