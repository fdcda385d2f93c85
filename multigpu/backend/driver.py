"""The life of every training and test step, on every backend: the one place a step is taken again.

A backend's steps give :class:`StepDriver` one attempt at a step on a given
batch and plan; the driver owns everything around it, the same on torch and
TensorFlow:

1. **the plan**: taken from the planner (this rank's rows and gradient
   weight ``b_r / B``, :mod:`multigpu.planning.plan`), cut again when it gave
   rows to a rank lost since it was drawn, or planned over ranks coming back
   (:meth:`Recovery.welcome <multigpu.backend.recovery.Recovery.welcome>`);
2. **calibration**, on the first step with automatic shares;
3. **keep, try, take again**: what a step changes before its sum is kept
   (:meth:`Recovery.keep`) where the run may lose a rank or a device may run
   out of memory; the attempt runs; after a lost peer
   (:class:`~multigpu.membership.PeerLostError`) the ranks left take the
   same global batch again (:meth:`Recovery.after_loss`), and after a rank
   ran out of memory (:class:`~multigpu.balancing.caps.OutOfMemoryStepError`,
   raised on every rank by the step's summed message) the step's forward
   changes are put back and the batch is cut again by the lowered caps
   (:meth:`DeviceMemory.cut_again <multigpu.balancing.caps.DeviceMemory.cut_again>`).

4. **the step's message** (:mod:`multigpu.backend.message`): what this rank
   says in its sum (:meth:`StepDriver.say`), the rows of this rank's batch
   run under the memory policy (:meth:`StepDriver.local`: an out-of-memory
   error there leaves the rank with nothing to send but its word), the
   summed message read (:meth:`StepDriver.heard`: new caps, and every rank
   raises when one ran out), and the step finished
   (:meth:`StepDriver.finish`: recovery notes the sum, the balancer the
   timings; :meth:`StepDriver.done`: the memory policy notes the sizes that
   fitted, the step's time is taken).

A backend's steps declare, for the driver: ``recovery`` and ``memory`` (their
owners), ``timing``, ``comm`` and ``balancer``, ``lost_peer(exc)`` (the lost
peer an exception stands for, once unwrapped from the framework's error),
``restore_forward(kept)``, ``restore_metrics()`` and ``_calibrate_on(data,
plan)``.  No backend catches a lost peer or an out-of-memory step itself.

5. **devices set aside** (:mod:`multigpu.backend.parking`): a rank set aside
   takes the plan and returns its last logs (the leader: the rank left's of
   the same step); a rank left sums over the ranks
   left only (a batch planned before the move, with rows for them, is
   stepped on by every rank together).
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from multigpu import membership
from multigpu._keras.model_parts import batch_rows
from multigpu.backend.message import Read, StepMessage
from multigpu.backend.parking import SetAside
from multigpu.balancing.caps import OutOfMemoryStepError, is_out_of_memory
from multigpu.balancing.timing import StepRecord

__all__ = ["StepDriver"]


def _same(data):
    return data


class StepDriver:
    """Runs one parallel model's steps (see the module docstring).

    Args:
        steps: the model's steps (:class:`~multigpu.backend.steps.StepsCore` with ``recovery`` and ``memory``).
        batch: what a batch cut again becomes before an attempt takes it (TensorFlow: tensors).
    """

    def __init__(self, steps, batch: Callable = _same) -> None:
        self.steps = steps
        self.batch = batch
        self.message = StepMessage(steps.timing.size, steps.comm.world_size)
        self.aside = SetAside(steps)  # devices set aside: their steps, and the moves at epoch boundaries

    def train(self, data, attempt: Callable, *, rows: int | None = None):
        """One training step on ``data`` (``rows`` rows here; by default its inputs' first dimension):
        ``attempt(data, plan)`` returns its logs, taken again as often as a lost peer or an out-of-memory step
        asks; the steps' ``_calibrate_on(data, plan)`` first, once."""
        steps = self.steps
        recovery, balancer = steps.recovery, steps.balancer
        if rows is None:
            rows = batch_rows(keras.utils.unpack_x_y_sample_weight(data)[0])
        plan = balancer.planner.take(rows)
        if self.aside.here and not plan.local:
            return self.aside.stand_still()  # set aside: no rows, no sum (multigpu.backend.parking)
        if balancer.lost and any(plan.sizes[r] for r in balancer.lost):
            data, plan = recovery.cut_again(plan)  # planned ahead of a loss (a DataLoader draws a few batches ahead)
            data = self.batch(data)
        if recovery.welcome_due:
            plan, data = recovery.welcome()
            data = self.batch(data)
        if not balancer.calibrated:
            steps._calibrate_on(data, plan)
        while True:
            kept = recovery.keep(also=steps.memory.bounded)
            try:
                return self.aside.step(attempt, data, plan)
            except Exception as exc:
                lost = steps.lost_peer(exc)
                if lost is not None:
                    data, plan, logs = recovery.after_loss(lost, kept, for_step=True)
                    if logs is not None:
                        return logs  # the step was done elsewhere: this rank took its state
                elif isinstance(exc, OutOfMemoryStepError):
                    steps.restore_forward(kept)
                    steps.restore_metrics()
                    data, plan = steps.memory.cut_again(exc, plan)
                else:
                    raise
                data = self.batch(data)

    def evaluate(self, data, attempt: Callable):
        """One test step on ``data``: ``attempt(data)`` returns its logs, taken again after a lost peer."""
        recovery = self.steps.recovery
        while True:
            kept = recovery.keep()
            try:
                return attempt(data)
            except Exception as exc:
                lost = self.steps.lost_peer(exc)
                if lost is None:
                    raise
                data, _, _ = recovery.after_loss(lost, kept, for_step=False)
                data = self.batch(data)

    # ---------------------------------------------------------- the step's message
    def say(self, short: int = 0, cap: int = 0) -> list[float]:
        """This rank's message: its timings, the recovery word, and its memory slots (``short``: the rows it
        could not hold; ``cap``: the largest local batch it measured)."""
        steps = self.steps
        return self.message.pack(steps.comm.rank, steps.timing.vector(), steps.recovery.waiting(), short, cap)

    def local(self, rows: int, run: Callable, release: Callable, *, may_retry: bool = True) -> tuple:
        """``run()`` on this rank's ``rows`` rows under the memory policy: ``(its result, 0, the cap it
        measured)``, or, when it ran out of memory, ``(None, rows, 0)`` after ``release()`` gave back what the
        pass held (the rank then sends what a rank with no rows sends, and says so).  ``may_retry=False``: an
        out-of-memory error passes (a step the others cannot wait out)."""
        memory = self.steps.memory
        try:
            memory.begin(rows)
            membership.fault_out_of_memory(self.steps.comm.rank)
            out = run()
            return out, 0, memory.end(rows)
        except Exception as exc:
            if not may_retry or not is_out_of_memory(exc):
                raise
        release()
        return None, rows, 0

    def heard(self, tail) -> Read:
        """The summed message (a step's last :attr:`StepMessage.size` values), read; the memory policy takes
        the caps it says, and raises :class:`~multigpu.balancing.caps.OutOfMemoryStepError` on every rank
        when a rank ran out (before any rank applies the step)."""
        said = self.message.read(tail)
        self.steps.memory.read(said.short, said.cap)
        return said

    def finish(self, tail, summed=None, offset: int = 0, adopt: dict | None = None) -> None:
        """A training step's summed message read after its update: recovery notes the sum (``summed``, the
        message at ``offset``) and its last word, the balancer the step's timings (``adopt``: another rank's
        shares, for a step this rank finishes with that rank's sum, :mod:`multigpu.backend.recovery`)."""
        steps = self.steps
        said = self.message.read(tail)
        if summed is not None:
            steps.recovery.read(summed, offset, waiting=said.waiting)
        members = steps.comm.members if steps.recovery.elastic else None  # (an elastic group's ranks left)
        if steps.comm.alone:
            members = [steps.comm.rank]  # (the others set aside: this rank's sum was its own)
        elif steps.comm.among is not None:
            members = list(steps.comm.among)  # (the others set aside: the sum was over the ranks left)
        rec = StepRecord.from_vector(said.timing, steps.comm.world_size, complete=True, members=members)
        if adopt is None:
            steps.balancer.record(rec)
        else:
            steps.balancer.caught_up(rec, **adopt)

    def done(self, plan, measured: bool = True) -> None:
        """A training step is over: the memory policy notes the local sizes that fitted, and the step's time
        is taken (kept for the shares unless not ``measured``: a step that traced, compiled or recorded)."""
        steps = self.steps
        steps.memory.fitted(plan.sizes)
        steps.timing.end(plan.local)
        if not measured:
            steps.timing.discard()
