"""Which rank owns which variable's optimizer state (``parallelize(..., shard_optimizer=True)``), pure Python.

With a sharded optimizer each variable's optimizer state (Adam's two moments,
a momentum, ...) lives on one rank, its owner, which alone applies the
variable's update; the new values then reach every rank.  The parts follow
each device's memory: a device with twice the memory owns about twice the
state.  Whole variables are the unit (a variable's state is never cut), so
the parts match the weights only as closely as the variables' sizes allow;
the largest variables are placed first, each on the rank whose part is then
the smallest for its memory (the classic longest-first rule), which keeps
every part within one variable of its target.

The same sizes and weights give the same owners on every rank, so the ranks
agree without a collective.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["memory_weights", "owners", "parts"]


def owners(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """The owning rank of each variable.

    Args:
        sizes: each variable's number of values, in the optimizer's order.
        weights: each rank's share of the state (its memory; equal where unknown); 0 for a rank that holds
            none (a device set aside), at least one above 0.

    Returns:
        One rank per variable.

    Raises:
        ValueError: when a weight is below 0, none is above 0, or no rank is given.
    """
    if not weights or any(not w >= 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"each rank's weight must be 0 or more, one above 0. Received: {list(weights)}")
    load = [0.0] * len(weights)
    out = [0] * len(sizes)
    holders = [r for r in range(len(weights)) if weights[r] > 0]
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        rank = min(holders, key=lambda r: ((load[r] + sizes[i]) / weights[r], r))
        out[i] = rank
        load[rank] += sizes[i]
    return out


def parts(sizes: Sequence[int], owner: Sequence[int], world_size: int) -> list[int]:
    """How many values each rank owns."""
    out = [0] * world_size
    for size, rank in zip(sizes, owner):
        out[rank] += int(size)
    return out


def memory_weights(memory: Sequence[int | None]) -> list[float]:
    """Each rank's weight from its device's memory in bytes: the memory where every device's is known, else
    equal weights (one unknown size makes the others no guide)."""
    if memory and all(m is not None and m > 0 for m in memory):
        return [float(m) for m in memory]  # type: ignore[arg-type]
    return [1.0] * len(memory)
