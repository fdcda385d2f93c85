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

A backend's steps declare, for the driver: ``recovery`` and ``memory`` (their
owners), ``lost_peer(exc)`` (the lost peer an exception stands for, once
unwrapped from the framework's error), ``restore_forward(kept)`` and
``restore_metrics()``.  No backend catches a lost peer or an out-of-memory
step itself.
"""

from __future__ import annotations

from collections.abc import Callable

from multigpu.balancing.caps import OutOfMemoryStepError

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

    def train(self, data, rows: int, attempt: Callable, calibrate: Callable | None = None):
        """One training step on ``data`` (``rows`` rows here): ``attempt(data, plan)`` returns its logs, taken
        again as often as a lost peer or an out-of-memory step asks; ``calibrate(data, plan)`` first, once."""
        steps = self.steps
        recovery, balancer = steps.recovery, steps.balancer
        plan = balancer.planner.take(rows)
        if balancer.lost and any(plan.sizes[r] for r in balancer.lost):
            data, plan = recovery.cut_again(plan)  # planned ahead of a loss (a DataLoader draws a few batches ahead)
            data = self.batch(data)
        if recovery.welcome_due:
            plan, data = recovery.welcome()
            data = self.batch(data)
        if not balancer.calibrated and calibrate is not None:
            calibrate(data, plan)
        while True:
            kept = recovery.keep(also=steps.memory.bounded)
            try:
                return attempt(data, plan)
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
