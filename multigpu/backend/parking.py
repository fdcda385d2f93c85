"""Devices set aside and taken back, on the steps of every backend (their sums can leave ranks out).

The judgment is :mod:`multigpu.balancing.parking`'s; this module makes the
moves, at epoch boundaries, where every rank runs the same hooks
(:class:`multigpu.keras.callbacks.EpochHooks`):

* **aside** (an epoch's start): the ranks set aside get no rows; with the
  optimizer state in parts, their parts move to the ranks left (a
  collective); each rank forgets its last global results: at the epoch's
  end they are the rank left's own (the others' metric states stay zero),
  or those of the ranks left summed among themselves, sent with the step
  records' totals in one message that the ranks left do not wait on
  (:meth:`SetAside.epoch_results`, through the run's store: the ranks set
  aside, however slow, hold no one up; summed over every rank where a step
  was taken by every rank this epoch);
* **a step** (:meth:`SetAside.step`): a rank set aside takes the step's plan
  and returns its last logs; the leader set aside (whose progress bar and
  callbacks the user sees) returns the rank left's instead, as it trains
  (:class:`LogsRelay`: the rank left leaves its newest logs in the run's
  store from a thread of its own, and the leader's step waits for those of
  its step); the epoch's are global; a rank left sums over the ranks left only,
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

import itertools
import threading
import time

import keras
import numpy as np

__all__ = ["LogsRelay", "SetAside", "allowed"]

_RELAYS = itertools.count()  # one store key per parallel model (made in the same order on every rank)


def allowed(steps) -> bool:
    """Whether ``steps`` may set devices aside: automatic shares, steps whose sums can leave ranks out
    (:meth:`~multigpu.backend.steps.StepsCore.can_set_aside`), no global BatchNorm statistics (their sums run inside
    the forward pass), no ``min_devices``, no weights in parts (every rank's passes gather them)."""
    return (steps.can_set_aside() and steps.balancer.options.auto and steps.comm.world_size > 1
            and not steps.parallel.options.sync_batchnorm and getattr(steps.comm, "min_devices", None) is None
            and not getattr(steps.parallel.options, "shard_weights", False))


class LogsRelay:
    """The rank left's per-batch logs to the leader set aside, so that the progress bar and the batch callbacks
    the user sees move as the training does.

    The rank left offers its logs after each step (:meth:`offer`: no wait); a thread of its own converts the
    newest to NumPy and posts it in the run's store (``comm.post``), at most every :attr:`INTERVAL` seconds and at
    once after an epoch's last step (:meth:`flush`), so that the step loses nothing to the store's round trip.
    The leader's step set aside waits (:meth:`logs_for`) until the logs of its step or a later one are there.

    Args:
        comm: the run's collectives (``post`` and ``peek``; the leader waits for a step's logs for the run's
            timeout).
    """

    # Seconds between two posts of the rank left (the leader's bar lags the training by as much): a post on JAX
    # holds the device left's Python for the coordination service's round trip (about 0.7 ms); every 10 ms, its
    # MLP at batch 64 with the leader set aside ran 0.89x what it ran without the relay (medians of three).
    INTERVAL = 0.1
    POLL = 0.002  # seconds between two looks of the leader (a slow leader spends little of its core on them)

    def __init__(self, comm) -> None:
        self.comm = comm
        self._name = f"aside-logs/{next(_RELAYS)}"
        self._epochs = 0  # epochs begun (every rank counts them): each has its own key
        self._newest: tuple | None = None  # (key, index, logs) offered last
        self._wake, self._now = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: tuple | None = None  # the leader: the newest (index, logs) it read

    @property
    def key(self) -> str:
        """Where this epoch's logs go (a rank left that runs into the next epoch does not overwrite them)."""
        return f"{self._name}/{self._epochs}"

    def epoch_begins(self) -> None:
        """Every rank, at each epoch's start."""
        self._epochs += 1
        self._seen = None

    # ------------------------------------------------------------- the rank left
    def offer(self, index: int, logs) -> None:
        """The logs of the step counted ``index`` (any backend's tensors), for the thread to post."""
        self._newest = (self.key, index, logs)
        if self._thread is None:
            self._thread = threading.Thread(target=self._post, name="multigpu-logs-relay", daemon=True)
            self._thread.start()
        self._wake.set()

    def flush(self) -> None:
        """The epoch's last step is over: its logs posted without the pause (the leader walks to the epoch's end,
        where the rank left may wait for it)."""
        self._now.set()
        self._wake.set()

    def _post(self) -> None:
        posted, quiet_until = None, 0.0
        while True:
            self._wake.wait()
            pause = quiet_until - time.monotonic()
            if pause > 0:
                self._now.wait(pause)
            self._wake.clear()
            self._now.clear()
            newest = self._newest
            if newest is None or newest is posted:
                continue
            try:
                message = (newest[1], _to_numpy(newest[2]))
            except Exception as exc:  # a log the relay cannot send: the leader's wait names it instead of timing out
                message = (newest[1], None, f"{type(exc).__name__}: {exc}")
            try:
                self.comm.post(newest[0], message)
            except Exception:  # the run is ending (its store went away): the leader's own wait says so
                return
            posted, quiet_until = newest, time.monotonic() + self.INTERVAL

    # ------------------------------------------------------------- the leader set aside
    def logs_for(self, index: int) -> dict:
        """The rank left's logs for the step counted ``index``: the first posted at or after it, in this epoch."""
        timeout = self.comm.runtime.timeout
        deadline = time.monotonic() + timeout
        while self._seen is None or self._seen[0] < index:
            found = self.comm.peek(self.key)
            if found is not None and len(found) == 3:
                raise TypeError(f"the device left's logs of step {found[0]} could not be sent to rank 0 "
                                f"({found[2]}); a train step's logs must be numbers or arrays")
            if found is not None and (self._seen is None or found[0] > self._seen[0]):
                self._seen = found
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"the device left sent no logs of step {index} within {timeout:g} s")
            time.sleep(self.POLL)
        return self._seen[1]


def _to_numpy(logs) -> dict:
    """Logs as Python floats (NumPy arrays where not scalars), off any device."""
    out = {}
    for name, value in dict(logs or {}).items():
        array = keras.ops.convert_to_numpy(value)
        out[name] = float(array) if np.ndim(array) == 0 else np.asarray(array)
    return out


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
        self.relay = LogsRelay(steps.comm)  # the rank left's per-batch logs to the leader set aside

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

    @property
    def relaying(self) -> bool:
        """Whether the leader is set aside: the rank left relays its per-batch logs to it."""
        return self.judgment.kept is not None and self.comm.leader in self.judgment.parked

    def stand_still(self):
        """A step of a rank set aside (no rows, no sum): the rank left's logs of the same step on the leader (the
        progress bar and the batch callbacks the user sees), its own last logs on another rank."""
        self.taken += 1
        if self.comm.rank == self.comm.leader and self.relaying:
            with self.comm.fatal("waiting for the logs of the device left"):
                return self.steps.stand_still(self.relay.logs_for(self.taken))
        return self.steps.stand_still(self.steps.logs_in(self.logs))

    def step(self, attempt, data, plan):
        """``attempt(data, plan)`` on a rank left (its sums over the ranks left), whose logs go to the leader
        where it is set aside (:class:`LogsRelay`)."""
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
        if self.comm.rank == self.judgment.kept and self.relaying:
            self.relay.offer(self.taken, self.steps.logs_in(self.logs))
        self.steps.forget_results()  # the epoch's results come from the rank left at its end
        return self.logs

    # ------------------------------------------------------------- epoch boundaries (every rank)
    def epoch_begins(self, epoch: int) -> None:
        """Sets aside the ranks the judgment named, if any."""
        self._together = False
        self.relay.epoch_begins()
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

    def epoch_results(self, local, summed) -> dict | None:
        """The epoch's global results while devices are set aside (a backend's ``get_metrics_result``, every
        rank): on the ranks left, ``local()`` where one is left (the others took no step: their metric states are
        zeros), else ``summed()`` over the ranks left only; sent from the rank left that the judgment keeps, with
        what :meth:`epoch_ending` shares, in one message that it does not wait on (``comm.publish``: the ranks set
        aside, however slow, hold no one up); None where the others' states count (no device aside, or a step
        taken by every rank this epoch): the backend sums them."""
        kept, left = self.judgment.kept, self.judgment.left
        if not self.judgment.parked or self._together:
            return None
        if self.comm.rank == kept and self.relaying:
            self.relay.flush()  # the epoch's last logs to the leader, which walks on to this epoch's end
        tally = self.balancer.tally
        mine = None
        if len(left) > 1 and self.comm.rank in left:
            self.comm.among = left
            try:
                ours = summed()
            finally:
                self.comm.among = None
        else:
            ours = local() if self.comm.rank == kept else None
        if self.comm.rank == kept:
            mine = ({k: np.asarray(v) if np.ndim(v) else float(v) for k, v in ours.items()}, tally.totals,
                    self.judgment.measured)
        results, totals, self.judgment.measured = self.comm.publish(mine, kept, "judging the devices set aside")
        tally.take(totals)
        self._shared_at = self.taken
        return results

    def epoch_ending(self) -> None:
        """The rank left's epoch on every rank (before the epoch's report): its step records' totals and its
        time alone, which the ranks set aside did not see, so that the report and the trial's verdict are the
        same everywhere (sent already with the epoch's results where no step came since:
        :meth:`epoch_results`); one way, as those."""
        if not self.judgment.parked or self._shared_at == self.taken:
            return
        kept, tally = self.judgment.kept, self.balancer.tally
        mine = (tally.totals, self.judgment.measured) if self.comm.rank == kept else None
        totals, self.judgment.measured = self.comm.publish(mine, kept, "judging the devices set aside")
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
