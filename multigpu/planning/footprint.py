"""What a model's first training step adds to each device's memory, by how much of the training state is in parts.

Pure arithmetic, the same on every backend.  Before ``fit``'s first step a
device already holds the weights; the step then makes the gradients and the
optimizer builds its state.  For ``T`` bytes of trainable weights, an
optimizer holding ``S`` values per weight (Adam: 2, SGD with momentum: 1) and
a device owning the state of ``t`` of those bytes (its part:
:mod:`multigpu.planning.partition`), the step adds on that device:

===============================  ==========================  =============
level (``parallelize`` argument)  gradients kept               optimizer state
===============================  ==========================  =============
``shard_optimizer=False``          ``T``                        ``S·T``
``shard="optimizer"``              ``T``                        ``S·t``
``shard="gradients"``              0 (written into the sum)     ``S·t``
``shard="weights"``                0, and ``T - w`` let go      ``S·t``
===============================  ==========================  =============

With ``shard="weights"`` the device lets go of the weights it does not own
(``w``: the bytes of those it owns) and gathers one layer's at a time
(at least the largest variable, ``L``, comes back): it adds ``S·t + L - (T - w)``.

An optimizer already built holds its state already (nothing more is added).
It is a lower bound: the step's activations, the sum's buffers between
machines and the framework's scratch space come on top, and are what the
memory caps measure (:mod:`multigpu.balancing.caps`); a device that cannot
hold even this cannot take a first step at any batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LEVELS", "SPELLING", "Footprint", "holds", "largest_model"]

LEVELS = ("whole", "optimizer", "gradients", "weights")
SPELLING = {"whole": "shard_optimizer=False", "optimizer": "shard='optimizer'", "gradients": "shard='gradients'",
            "weights": "shard='weights'"}


@dataclass(frozen=True)
class Footprint:
    """The training state a model's first step adds on every device.

    Attributes:
        gradients: bytes of one copy of the gradients (the trainable weights' bytes).
        state: bytes of the whole optimizer state (0 where the optimizer is built: it is held already).
        owned: for each rank, bytes of the optimizer state of the part it owns when the state is in parts.
        weights_owned: for each rank, bytes of the trainable weights it owns (``shard="weights"``).
        largest: bytes of the largest trainable variable (what a layer's gather brings back at least).
    """

    gradients: int
    state: int
    owned: Sequence[int]
    weights_owned: Sequence[int] = ()
    largest: int = 0

    @classmethod
    def of(cls, sizes: Sequence[int], itemsizes: Sequence[int], slots: float, owner: Sequence[int],
           world_size: int, built: bool) -> Footprint:
        """From each trainable variable's number of values and bytes a value, the optimizer's values per weight
        (``slots``), each variable's owning rank, and whether the optimizer is built."""
        nbytes = [int(n) * int(b) for n, b in zip(sizes, itemsizes)]
        owned = [0] * world_size
        for size, rank in zip(nbytes, owner):
            owned[rank] += size
        factor = 0.0 if built else float(slots)
        return cls(sum(nbytes), int(factor * sum(nbytes)), [int(factor * o) for o in owned], owned,
                   max(nbytes, default=0))

    def adds(self, level: str, rank: int) -> int:
        """Bytes the first step adds on ``rank`` at ``level`` (one of :data:`LEVELS`)."""
        if level not in LEVELS:
            raise ValueError(f"`level` must be one of {', '.join(LEVELS)}. Received: {level!r}")
        if level == "weights":
            return int(self.owned[rank]) + self.largest - (self.gradients - int(self.weights_owned[rank]))
        kept = 0 if level == "gradients" else self.gradients
        return kept + (self.state if level == "whole" else int(self.owned[rank]))


def holds(level: str, weights: int, itemsize: int, slots: float, parts: Sequence[float]) -> list[float]:
    """Bytes each device holds for a model of ``weights`` values of ``itemsize`` bytes trained at ``level``: the
    weights, the gradients it keeps and the optimizer state it holds (``slots`` values a weight), each device
    owning the fraction ``parts[r]`` of the state (they add up to 1; the variables' sizes are not known here,
    so the parts are exact fractions)."""
    if level not in LEVELS:
        raise ValueError(f"`level` must be one of {', '.join(LEVELS)}. Received: {level!r}")
    if level == "weights":  # its part of the weights and of their optimizer state (a layer's gather on top)
        return [float(weights) * itemsize * part * (1 + slots) for part in parts]
    kept = 0 if level == "gradients" else 1
    return [float(weights) * itemsize * (1 + kept + slots * (1.0 if level == "whole" else part)) for part in parts]


def largest_model(level: str, memory: Sequence[int | None], itemsize: int, slots: float,
                  parts: Sequence[float]) -> int | None:
    """The most weights whose training state every device of known ``memory`` holds at ``level`` (an upper
    bound: the steps' activations come on top); None where no device's memory is known."""
    per_weight = holds(level, 1, itemsize, slots, parts)
    found = [int(m // b) for m, b in zip(memory, per_weight) if m is not None]
    return min(found) if found else None
