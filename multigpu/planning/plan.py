"""Step plans: which rows of a global batch each device takes, and in which order.

Pure Python.  A global step of ``B`` rows is cut into contiguous runs, one per
device in rank order, of ``shares[r]`` rows each.  Step ``i`` of an epoch of
arrays covers rows ``[i*B, min((i+1)*B, n))`` of the (shuffled) data; the
ragged last step is cut by the same ratios, so a device may get no rows there.

:class:`StepPlanner` is the one place where a step's shares are decided: the
data path asks it to plan each global batch as it cuts it, and the training
step takes the plans back in the same order (a batch is produced right before
its step, so the queue holds one plan, two at most).  The gradient weight of a
rank is ``plan.local / plan.total``.

Where the data can cut a batch again (arrays held in memory), each plan comes
with a way to do so: when a device is lost during a step, the step plans the
same global batch again over the devices left and takes its new rows
(:meth:`StepPlanner.again`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["StepPlan", "StepPlanner", "epoch_plan", "num_steps"]


@dataclass(frozen=True)
class StepPlan:
    """One global step: every rank's rows.

    Attributes:
        sizes: rows per rank, summing to the step's global batch.
        rank: the rank this plan is read by.
    """

    sizes: tuple[int, ...]
    rank: int

    @property
    def total(self) -> int:
        """Rows in the global step."""
        return sum(self.sizes)

    @property
    def local(self) -> int:
        """This rank's rows."""
        return self.sizes[self.rank]

    @property
    def begin(self) -> int:
        """Offset of this rank's rows within the step."""
        return sum(self.sizes[: self.rank])

    @property
    def weight(self) -> float:
        """This rank's gradient weight ``b_r / B`` (0 for an empty step)."""
        total = self.total
        return self.local / total if total else 0.0

    @property
    def complete(self) -> bool:
        """True when every rank has rows in this step."""
        return all(s > 0 for s in self.sizes)

    def rows(self, rank: int, start: int = 0) -> tuple[int, int]:
        """``[begin, end)`` of ``rank``'s rows, for a step starting at row ``start``."""
        begin = start + sum(self.sizes[:rank])
        return begin, begin + self.sizes[rank]


def num_steps(num_rows: int, batch_size: int) -> int:
    """Number of global steps that cover ``num_rows`` rows (the last one ragged)."""
    if batch_size <= 0:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size}")
    return -(-num_rows // batch_size)


def epoch_plan(num_rows: int, batch_size: int, shares: Callable[[int], Sequence[int]],
               rank: int = 0) -> list[tuple[int, StepPlan]]:
    """Every step of an epoch with fixed shares: ``(first row, plan)`` per step.

    Args:
        num_rows: rows in the data.
        batch_size: the global batch ``B``.
        shares: rows per rank of a global batch of a given size.
        rank: the rank the plans are read by.

    Returns:
        One entry per step; all but possibly the last have ``B`` rows.
    """
    out = []
    for step in range(num_steps(num_rows, batch_size)):
        start = step * batch_size
        stop = min(start + batch_size, num_rows)
        out.append((start, StepPlan(tuple(shares(stop - start)), rank)))
    return out


class StepPlanner:
    """Plans global batches (shares decided now) and hands the plans to the step.

    Args:
        shares: rows per rank of a global batch of a given size, as the
            balancer decides them at the time of the call.
        rank: this process's rank.
    """

    def __init__(self, shares: Callable[[int], Sequence[int]], rank: int) -> None:
        self._shares = shares
        self.rank = rank
        self._queue: deque[tuple[StepPlan, Callable | None]] = deque()
        self._current: dict[bool, tuple[StepPlan, Callable | None]] = {}  # for_step -> the batch being stepped on
        self.taken = 0  # training steps handed a plan, over the run

    def plan(self, total: int, *, for_step: bool = True, again: Callable[[StepPlan], object] | None = None
             ) -> StepPlan:
        """The plan of a global batch of ``total`` rows.

        Args:
            total: rows in the global batch.
            for_step: queue the plan for the training step (training data);
                ``False`` for evaluation and prediction.
            again: cuts this rank's rows of the same global batch by another
                plan (None where the data cannot: it was read once).
        """
        plan = StepPlan(tuple(self._shares(total)), self.rank)
        if for_step:
            self._queue.append((plan, again))
        else:
            self._current[False] = (plan, again)
        return plan

    def again(self, for_step: bool = True) -> tuple[StepPlan, object] | None:
        """The batch being stepped on, planned again by the shares now: ``(plan, this rank's rows)``, or None
        where its data cannot cut it again."""
        plan, again = self._current.get(for_step, (None, None))
        if plan is None or again is None:
            return None
        plan = StepPlan(tuple(self._shares(plan.total)), self.rank)
        return plan, again(plan)

    @property
    def can_cut_again(self) -> bool:
        """Whether the batch being stepped on can be planned and cut again (arrays and tensors held in memory)."""
        return self._current.get(True, (None, None))[1] is not None

    def take(self, local_rows: int) -> StepPlan:
        """The oldest queued plan: the one of the batch this step received.

        Raises:
            RuntimeError: when no plan is queued, or the batch does not have
                the rows its plan gives this rank.
        """
        if not self._queue:
            raise RuntimeError(
                "multigpu: a training step ran on a batch that multigpu did not cut. Feed training data "
                "through fit(), train_on_batch() or a model parallelized with multigpu.parallelize()."
            )
        plan, again = self._queue.popleft()
        self._current[True] = (plan, again)
        self.taken += 1
        if plan.local != local_rows:
            self._queue.clear()
            raise RuntimeError(
                f"multigpu: rank {self.rank}'s training step received a batch of {local_rows} rows, but the next "
                f"batch that fit() or train_on_batch() cut gives this rank {plan.local} ({list(plan.sizes)}): the "
                "step was not given the batches they read, in their order. This happens when training steps are "
                "driven outside them while they run: train_on_batch(), train_step() or train_function() called "
                "from a callback or another thread during fit(), or a loop of your own calling train_step() on "
                "batches of its own. Train only through the parallel model's fit() or train_on_batch(), one call "
                "at a time."
            )
        return plan

    def reset(self) -> None:
        """Forgets batches cut but never trained on (a peek, an interrupted epoch)."""
        self._queue.clear()
        self._current.clear()
