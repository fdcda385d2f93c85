"""Batch planning: split a global batch across devices in proportion to ratios.

Pure Python (no framework import), so that the arithmetic can be tested on its
own and reused by the launcher, the data sharding and the rebalancer.

The rules:

* ``split(B, ratios)`` gives integer shares that sum to ``B``, each within one
  sample of ``B * r / sum(ratios)`` (largest-remainder method), and every
  device with a positive ratio gets at least one sample whenever ``B`` is at
  least the number of such devices.
* ``epoch_plan(n, B, ratios)`` cuts ``n`` rows into steps of ``B`` rows (the
  last one ragged) and each step into per-device slices.  Step ``i`` covers
  rows ``[i*B, min((i+1)*B, n))``; device ``r`` takes a contiguous slice of
  it, devices in rank order.  The ragged last step is cut by the same ratios;
  a device may get zero rows there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StepSlice", "epoch_plan", "num_steps", "split", "validate_ratios"]


def validate_ratios(ratios: Sequence[float], world_size: int | None = None) -> list[float]:
    """Checks ratios and returns them as floats.

    Args:
        ratios: one non-negative, finite number per device; at least one must
            be positive.
        world_size: when given, the number of ratios required.

    Returns:
        The ratios as a list of floats.

    Raises:
        ValueError: naming the bad value and what is allowed.
    """
    try:
        values = [float(r) for r in ratios]
    except (TypeError, ValueError):
        raise ValueError(
            "`ratios` must be a sequence of positive numbers, one per device. "
            f"Received: ratios={ratios!r}"
        ) from None
    if world_size is not None and len(values) != world_size:
        raise ValueError(
            f"`ratios` must have one entry per device ({world_size} devices), "
            f"got {len(values)}. Received: ratios={list(ratios)!r}"
        )
    if not values:
        raise ValueError(f"`ratios` must not be empty. Received: ratios={list(ratios)!r}")
    for r in values:
        if not math.isfinite(r) or r <= 0:
            raise ValueError(
                "Every ratio must be a finite number greater than 0. "
                f"Received: ratios={list(ratios)!r}"
            )
    return values


def split(total: int, ratios: Sequence[float]) -> list[int]:
    """Splits ``total`` samples into integer shares proportional to ``ratios``.

    Largest-remainder rounding: each share is ``floor`` or ``ceil`` of its exact
    value, and the shares sum to ``total``.  When ``total`` is at least the
    number of positive ratios, every device with a positive ratio gets at least
    one sample (taken from the largest shares).  Zero ratios get zero.

    Args:
        total: number of samples to split, ``>= 0``.
        ratios: non-negative weights, at least one positive.

    Returns:
        A list of non-negative ints, one per ratio, summing to ``total``.

    Example:
        >>> split(256, [3, 1])
        [192, 64]
        >>> split(1, [1, 1])
        [1, 0]
    """
    if total < 0:
        raise ValueError(f"`total` must be >= 0. Received: total={total}")
    weights = [float(r) for r in ratios]
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"ratios must be finite and >= 0. Received: ratios={list(ratios)!r}")
    norm = sum(weights)
    if norm <= 0:
        raise ValueError(f"at least one ratio must be > 0. Received: ratios={list(ratios)!r}")
    exact = [total * w / norm for w in weights]
    shares = [math.floor(e) for e in exact]
    left = total - sum(shares)
    # Largest remainder first; ties go to the lower rank, so every rank
    # computes the same answer.
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[:left]:
        shares[i] += 1
    positive = [i for i, w in enumerate(weights) if w > 0]
    if total >= len(positive):
        for i in positive:
            if shares[i] == 0:
                donor = max(range(len(shares)), key=lambda j: (shares[j], -j))
                shares[donor] -= 1
                shares[i] += 1
    return shares


@dataclass(frozen=True)
class StepSlice:
    """The rows of one global step and how they are cut across devices.

    Attributes:
        start: first row of the step (inclusive).
        stop: last row of the step (exclusive).
        shares: rows per device; sums to ``stop - start``.
    """

    start: int
    stop: int
    shares: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.stop - self.start

    def rows(self, rank: int) -> tuple[int, int]:
        """Returns the ``[begin, end)`` rows that ``rank`` takes in this step."""
        begin = self.start + sum(self.shares[:rank])
        return begin, begin + self.shares[rank]


def num_steps(num_rows: int, batch_size: int) -> int:
    """Number of global steps that cover ``num_rows`` rows (last one ragged)."""
    if batch_size <= 0:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size}")
    return -(-num_rows // batch_size)


def epoch_plan(num_rows: int, batch_size: int, ratios: Sequence[float]) -> list[StepSlice]:
    """Cuts ``num_rows`` rows into global steps and per-device slices.

    Args:
        num_rows: rows in the data set.
        batch_size: the global batch ``B``.
        ratios: one weight per device.

    Returns:
        One :class:`StepSlice` per step; all but possibly the last have
        ``B`` rows.
    """
    full = split(batch_size, ratios)
    plan = []
    for step in range(num_steps(num_rows, batch_size)):
        start = step * batch_size
        stop = min(start + batch_size, num_rows)
        shares = full if stop - start == batch_size else split(stop - start, ratios)
        plan.append(StepSlice(start, stop, tuple(shares)))
    return plan
