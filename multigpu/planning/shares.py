"""Ratios and shares: the one parser for ratios, and the integer split of a batch.

Pure Python (no framework import), so that the arithmetic is tested on its own
and every part of multigpu (the API, the command line, the balancer, the data
path) reads ratios the same way.

* :func:`parse_ratios` turns anything a user may write for ``ratios`` (a list
  of numbers, ``"3,1"``, ``"auto"``, the path of a profile file, ``None``)
  into a :class:`RatioSpec`.
* :func:`split` gives integer shares that sum to the batch, each within one
  sample of its exact value (largest remainder), and at least one sample for
  every device whenever the batch allows.
* :func:`capped_split` does the same under per-device caps (``max_batch``).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RatioSpec", "capped_split", "parse_ratios", "predicted_step_time", "split", "split_once", "validate_ratios"]


def validate_ratios(ratios: Sequence[float], world_size: int | None = None) -> list[float]:
    """Checks ratios and returns them as floats.

    Args:
        ratios: one finite number greater than 0 per device.
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
    if any(not math.isfinite(r) or r <= 0 for r in values):
        raise ValueError(f"Every ratio must be a finite number greater than 0. Received: ratios={list(ratios)!r}")
    return values


@dataclass(frozen=True)
class RatioSpec:
    """What the user asked for.

    Attributes:
        kind: ``"fixed"`` (``values`` given), ``"auto"`` (measure),
            ``"profile"`` (read ``path``) or ``"default"`` (``None``: automatic
            when the devices differ, equal otherwise).
        values: the ratios when ``kind == "fixed"``.
        path: the profile file when ``kind == "profile"``.
    """

    kind: str
    values: tuple[float, ...] | None = None
    path: str | None = None

    def text(self) -> str:
        """The spelling ``multigpu run --ratios`` takes (``"3,1"``, ``"auto"``, a path)."""
        if self.kind == "fixed":
            return ",".join(f"{v:g}" for v in self.values or ())
        return self.path if self.kind == "profile" else self.kind


_ALLOWED = "a list of positive numbers (e.g. [3, 1] or '3,1'), 'auto', the path of a profile .json file, or None"


def parse_ratios(ratios: object, world_size: int | None = None) -> RatioSpec:
    """Reads ``ratios`` in any form a user may give it.

    Args:
        ratios: ``None``, ``"auto"``, a profile path (``*.json``, str or
            ``os.PathLike``), comma-separated numbers (``"3,1"``) or a
            sequence of numbers.
        world_size: when given, the number of ratios a fixed spec must have.

    Returns:
        The :class:`RatioSpec`.

    Raises:
        ValueError: naming what was received and what is allowed.
    """
    if ratios is None:
        return RatioSpec("default")
    if isinstance(ratios, os.PathLike):
        return RatioSpec("profile", path=os.fspath(ratios))
    if isinstance(ratios, str):
        text = ratios.strip()
        if text.lower() == "auto":
            return RatioSpec("auto")
        if text.lower().endswith(".json"):
            return RatioSpec("profile", path=text)
        try:
            values = [float(t) for t in text.split(",")]
        except ValueError:
            raise ValueError(f"`ratios` must be {_ALLOWED}. Received: ratios={ratios!r}") from None
        return RatioSpec("fixed", tuple(validate_ratios(values, world_size)))
    if isinstance(ratios, (bytes, dict, set)) or not hasattr(ratios, "__iter__"):
        raise ValueError(f"`ratios` must be {_ALLOWED}. Received: ratios={ratios!r}")
    return RatioSpec("fixed", tuple(validate_ratios(list(ratios), world_size)))  # type: ignore[arg-type]


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


@functools.lru_cache(maxsize=64)
def split_once(total: int, ratios: tuple[float, ...], caps: tuple[int | None, ...] | None, quantum: int
               ) -> tuple[int, ...]:
    """:func:`capped_split` remembered (a step plans the same split as the last one at most steps)."""
    return tuple(capped_split(total, ratios, caps, quantum))


def capped_split(total: int, ratios: Sequence[float], caps: Sequence[int | None] | None = None,
                 quantum: int = 1) -> list[int]:
    """Like :func:`split`, but no device gets more than its cap, and shares come in multiples of ``quantum``.

    The excess of a capped device goes to the others in proportion to their
    ratios.  With ``quantum > 1`` the batch is split in units of ``quantum``
    rows and what is left (``total % quantum``) goes whole to the device with
    the largest ratio that has room: the local batch sizes stay on a small
    grid, for a backend that compiles once per size (JAX).  When the units do
    not fit the caps, the rows are split one by one.

    Raises:
        ValueError: when ``total`` exceeds the sum of the caps; the message
            gives the largest global batch that fits.
    """
    if quantum > 1 and total >= quantum:
        unit_caps = None if caps is None else [None if c is None else int(c) // quantum for c in caps]
        units = total // quantum
        if unit_caps is None or sum(math.inf if c is None else c for c in unit_caps) >= units:
            shares = [u * quantum for u in capped_split(units, ratios, unit_caps)]
            left = total - sum(shares)
            for i in sorted(range(len(ratios)), key=lambda i: (-float(ratios[i]), i)):
                room = math.inf if caps is None or caps[i] is None else int(caps[i]) - shares[i]
                if left == 0 or (float(ratios[i]) > 0 and room >= left):
                    shares[i] += left
                    return shares
    if caps is None or all(c is None for c in caps):
        return split(total, ratios)
    limits = [math.inf if c is None else int(c) for c in caps]
    if sum(limits) < total:
        raise ValueError(
            f"A global batch of {total} does not fit: the devices hold at most "
            f"{[int(c) for c in limits]} samples each, so the largest global batch that fits is "
            f"{int(sum(limits))}."
        )
    shares = [0] * len(ratios)
    free = [i for i in range(len(ratios)) if limits[i] > 0 and ratios[i] > 0]
    left = total
    while left > 0 and free:
        part = split(left, [ratios[i] for i in free])
        over = [i for i, p in zip(free, part) if shares[i] + p > limits[i]]
        if not over:
            for i, p in zip(free, part):
                shares[i] += p
            break
        for i in over:
            left -= int(limits[i]) - shares[i]
            shares[i] = int(limits[i])
        free = [i for i in free if i not in over]
    return shares


def predicted_step_time(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """Step time if device ``r`` processes ``shares[r]`` samples at ``speeds[r]`` samples/s."""
    return max((b / s if b else 0.0) for b, s in zip(shares, speeds))
