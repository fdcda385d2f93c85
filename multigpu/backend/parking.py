"""Devices set aside and taken back, on the steps of every backend (their sums can leave ranks out).

The judgment is :mod:`multigpu.balancing.parking`'s; this module makes the
moves, at epoch boundaries, where every rank runs the same hooks
(:class:`multigpu.keras.callbacks.EpochHooks`):

* **aside** (an epoch's start): the ranks set aside get no rows; with the
  optimizer state in parts, their parts move to the ranks left (a
  collective); each rank forgets its last global results: at the epoch's
  end they are the rank left's own (the others' metric states stay zero),
  sent with its step records' totals in one message that it does not wait
  on (:meth:`SetAside.epoch_results`; summed over every rank where a step
  was taken by every rank this epoch);
* **a step** (:meth:`SetAside.step`): a rank set aside takes the step's plan
  and returns its last logs (its per-batch logs stand still while it is
  aside; the epoch's are global); a rank left sums over the ranks left only,
  which on one rank is no collective (``comm.alone``); a batch planned
  before the move with rows for a rank set aside (an input that draws
  ahead) is stepped on by every rank together, as before;
* **an epoch's end** while the leader is set aside (the device left is
  another): the rank left's weights sent to every rank, so that the leader's
  callbacks (``get_weights``, early stopping, a variable read) see what was
  trained; its optimizer state too before a save (:meth:`SetAside.up_to_date`,
  from the model's ``save``, which every rank calls), and not at every epoch
  (Adam's state is twice the weights, and a slow leader makes every rank wait
  for what it receives);
* **back** (an epoch's end when the trial lost, or to be measured again
  after some epochs aside, and every ``fit``'s end):
  the whole optimizer state on every rank, the rank left's weights, optimizer
  state and random streams sent to every rank (as to a rank that came back
  after a loss), and the shares from before.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SetAside", "allowed"]


def allowed(steps) -> bool:
    """Whether ``steps`` may set devices aside: automatic shares, steps whose sums can leave ranks out
    (:meth:`~multigpu.backend.steps.StepsCore.can_set_aside`), no global BatchNorm statistics (their sums run inside
    the forward pass), no ``min_devices``, no weights in parts (every rank's passes gather them)."""
    return (steps.can_set_aside() and steps.balancer.options.auto and steps.comm.world_size > 1
            and not steps.parallel.options.sync_batchnorm and getattr(steps.comm, "min_devices", None) is None
            and not getattr(steps.parallel.options, "shard_weights", False))


class SetAside:
    """The moves of one parallel model's devices set aside (see the module docstring).

    Args:
        steps: the model's steps (:class:`~multigpu.backend.steps.StepsCore`).
    """

    def __init__(self, steps) -> None:
        self.steps = steps
        self._weights: list[float] | None = None  # each rank's part of the optimizer state before
        self.logs = None  # this rank's last logs, which a step set aside returns
        # Steps taken with the leader set aside (every rank counts them), and the count when the rank left last
        # sent its weights, and its whole state, to every rank.
        self.taken = self._weights_at = self._state_at = 0
        self._together = False  # a step of this epoch was taken by every rank (planned before the move)
        self._shared_at = -1  # ``taken`` when the rank left last shared its epoch (:meth:`epoch_results`)

    @property
    def comm(self):
        return self.steps.comm

    @property
    def balancer(self):
        return self.steps.balancer

    @property
    def judgment(self):
        """The balancer's :class:`~multigpu.balancing.parking.Parking`."""
        return self.steps.balancer.parking

    @property
    def here(self) -> bool:
        """Whether this rank is set aside now."""
        return self.comm.rank in self.judgment.parked

    def step(self, attempt, data, plan):
        """``attempt(data, plan)`` on a rank left (its sums over the ranks left); on a rank set aside, its last
        logs."""
        parked = self.judgment.parked
        if not parked or any(plan.sizes[r] for r in parked):  # (a batch planned before the move: together)
            self._together = bool(parked)
            self.logs = attempt(data, plan)
            return self.logs
        left = self.judgment.left
        if len(left) == 1:
            self.comm.alone = True
        else:
            self.comm.among = left
        self.taken += 1
        try:
            self.logs = attempt(data, plan)
        finally:
            self.comm.alone, self.comm.among = False, None
        self.steps.forget_results()  # the epoch's results come from the rank left at its end
        return self.logs

    # ------------------------------------------------------------- epoch boundaries (every rank)
    def epoch_begins(self, epoch: int) -> None:
        """Sets aside the ranks the judgment named, if any."""
        self._together = False
        judgment = self.judgment
        if not judgment.due:
            return
        left = [r for r in self.comm.members if r not in judgment.due]
        if len(left) > 1 and not (judgment.groups and self.comm.form_subgroup(left)):
            judgment.due, judgment.kept, judgment.left = [], None, []  # (their sums cannot leave the others out)
            return
        self.balancer.set_ratios(judgment.park(self.balancer.ratios, epoch))
        shards = self.steps.shards
        if shards is not None:
            self._weights = list(shards.weights)
            shards.repartition([0.0 if r in judgment.parked else w for r, w in enumerate(shards.weights)])
        self.steps.forget_results()
        self.steps.sum_over_all(False)

    def epoch_results(self, local) -> dict | None:
        """The epoch's global results while devices are set aside (a backend's ``get_metrics_result``, every
        rank): the rank left's own, ``local()`` there (the others took no step: their metric states are
        zeros), sent with what :meth:`epoch_ending` shares, in one message that the rank left does not wait
        on (``comm.publish``); None where the others' states count (no device aside, or a step taken by every
        rank this epoch): the backend sums them."""
        kept = self.judgment.kept
        if not self.judgment.parked or self._together:
            return None
        if len(self.judgment.left) > 1:  # the ranks set aside hold zeros: the sum over every rank is the ranks left's
            return None
        tally = self.balancer.tally
        mine = None
        if self.comm.rank == kept:
            mine = ({k: np.asarray(v) if np.ndim(v) else float(v) for k, v in local().items()}, tally.totals,
                    self.judgment.measured)
        results, totals, self.judgment.measured = self.comm.publish(mine, kept, "judging the devices set aside")
        tally.take(totals)
        self._shared_at = self.taken
        return results

    def epoch_ending(self) -> None:
        """The rank left's epoch on every rank (before the epoch's report): its step records' totals and its
        time alone, which the ranks set aside did not see, so that the report and the trial's verdict are the
        same everywhere (sent already with the epoch's results where no step came since:
        :meth:`epoch_results`)."""
        if not self.judgment.parked or self._shared_at == self.taken:
            return
        kept, tally = self.judgment.kept, self.balancer.tally
        mine = (tally.totals, self.judgment.measured) if self.comm.rank == kept else None
        totals, self.judgment.measured = self.comm.share(mine, kept, "judging the devices set aside")
        tally.take(totals)

    def epoch_ends(self, epoch: int) -> None:
        """The trial's verdict (:meth:`epoch_ending` shared what it reads): the ranks set aside come back when
        the rank left ran slower, or to be measured again when they were aside long enough
        (:meth:`~multigpu.balancing.parking.Parking.remeasure_due`); while they stay aside and the leader is
        among them, the rank left's weights sent to every rank (its optimizer state goes before a save:
        :meth:`up_to_date`)."""
        if not self.judgment.parked:
            return
        kept = self.judgment.kept
        if not self.judgment.keeps_aside():
            self._back(epoch)
        elif self.judgment.remeasure_due():
            self._back(epoch, again=True)
        elif kept != self.comm.leader and self.taken > self._weights_at:
            self.steps._broadcast_variables(self.steps._state_variables(), "sending the weights to the leader", kept)
            self._weights_at = self.taken

    def up_to_date(self) -> None:
        """Before a save (every rank): while the leader is set aside, the rank left's whole state (weights and
        optimizer state) on every rank, where it trained since it last sent it."""
        kept = self.judgment.kept
        if self.judgment.parked and kept != self.comm.leader and self.taken > self._state_at:
            with self.steps.whole_optimizers():  # (optimizer state in parts: the rank left holds every part)
                self.steps._welcome_state(kept)
            self._weights_at = self._state_at = self.taken

    def fit_ends(self) -> None:
        """Every device back, with the rank left's state."""
        if self.judgment.parked:
            self._back(None)

    def _back(self, epoch: int | None, again: bool = False) -> None:
        shards = self.steps.shards
        if shards is not None:
            shards.gather()  # the ranks left hold every part: each rank holds the whole state
        self.steps._welcome_state(self.judgment.kept)  # its weights, optimizer state and random streams everywhere
        self.balancer.set_ratios(self.judgment.back(epoch, again))
        if shards is not None and self._weights is not None:
            shards.repartition(self._weights)
        self.steps.forget_results()
        self.steps.sum_over_all(True)
