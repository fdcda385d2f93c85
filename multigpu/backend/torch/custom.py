"""A ``train_step`` of the model's own on torch (``loss.backward()`` and ``optimizer.apply``).

The model's step runs as Keras runs it.  Each optimizer's ``apply`` (wrapped
once, when the optimizer is first seen: :meth:`GradientSync.wrap
<multigpu.backend.torch.reducer.GradientSync.wrap>`) first sums the
gradients times ``b_r / B`` over ranks, so a GAN's two optimizers work; the
step's logs become global in one more sum after it, which carries the step's
message.  A rank with no rows makes the same optimizer calls as its last
step with rows, with zeros.

The step's first sum also carries the memory word
(:meth:`~multigpu.balancing.caps.DeviceMemory.word`): a rank that ran out of
memory before it joins that sum with zeros and the rows it could not hold,
and every rank raises there, before any update (the driver takes the step
again).  A step that runs out after its first optimizer call ends the run:
some updates were applied.
"""

from __future__ import annotations

import torch

from multigpu import membership
from multigpu.balancing.caps import OutOfMemoryStepError, is_out_of_memory

__all__ = ["OwnTrainStep"]


class OwnTrainStep:
    """The model's own ``train_step``, with sums over ranks.

    Args:
        steps: the model's :class:`~multigpu.backend.torch.step.TorchSteps` (its model, gradient sums,
            metrics, memory policy and driver are used).
    """

    def __init__(self, steps) -> None:
        self.steps = steps
        self._calls: list[tuple] = []  # the optimizer calls of the last step with rows, made again without rows

    def train(self, data, plan) -> dict:
        """One training step on this rank's rows of ``data``; returns the global logs."""
        steps = self.steps
        sync, memory = steps.sync, steps.memory
        if steps.weights is not None and steps.weights.active and 0 in plan.sizes:  # (every rank raises)
            raise ValueError(
                "shard='weights' with a train_step of the model's own needs rows on every device at every step "
                "(each device's passes gather the weights), and a device has none in this batch. Received: rows "
                f"per device {list(plan.sizes)}. Use a global batch with rows for every device, or "
                "shard='gradients'.")
        sync.attach(torch.from_numpy(memory.word()))
        sync.read_extras = memory.read_word
        try:
            logs_local = None
            if plan.local > 0:
                try:
                    membership.fault_out_of_memory(steps.comm.rank)
                    with steps.metrics.local_results():
                        logs_local = steps.user_train_step(steps.model, data)
                except Exception as exc:
                    if (isinstance(exc, OutOfMemoryStepError) or not memory.bounded or sync.step.extras is None
                            or not is_out_of_memory(exc)):
                        raise  # (after its first sum, a step that ran out ends the run: some updates applied)
                    self._stand_in(plan.local)
                self._calls = list(sync.log)
            else:
                sync.replay(self._calls)
        finally:
            sync.read_extras = None
        return steps._sum_logs(logs_local, plan.local, steps.driver.say(), "train")

    def _stand_in(self, rows: int) -> None:
        """This rank ran out before the step's first sum: it joins that sum with zeros and its word, which
        raises on every rank (the step is taken again with fewer rows here)."""
        steps = self.steps
        steps._release()
        steps.sync.attach(torch.from_numpy(steps.memory.word(rows)))
        optimizer = steps.model.optimizer
        steps.sync.replay(self._calls[:1] or [(type(optimizer).apply.__get__(optimizer),
                                               list(steps.model.trainable_weights))])
