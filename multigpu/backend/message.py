"""The message every training step adds to its one sum, declared once for every backend.

A training step sums, over ranks and in one collective, the weighted
gradients, the metric states and then this message: named sections of
floats, each rank writing its own slots and zeros elsewhere, so that the sum
is the same on every rank and every rank reads the same facts from it.

========  =================  ====================================================
section   size               what a rank writes
========  =================  ====================================================
timing    the record's size  the step's timings (:class:`~multigpu.balancing.timing.StepRecord`)
waiting   1                  1 where ranks coming back wait to be taken in (:meth:`Recovery.waiting`)
short     one per rank       at its own rank: the rows it could not hold (it ran out of memory)
cap       one per rank       at its own rank: the largest local batch its memory holds, as measured
========  =================  ====================================================

:class:`StepMessage` packs it and reads it; no other code slices the tail
by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Read", "StepMessage"]


class Read(NamedTuple):
    """A summed message, by section."""

    timing: list[float]
    waiting: bool
    short: list[int]
    cap: list[int]


@dataclass(frozen=True)
class StepMessage:
    """The sections of a training step's message.

    Args:
        timing: how many timing slots the step record has.
        ranks: the run's world size.
    """

    timing: int
    ranks: int

    @property
    def sections(self) -> dict[str, tuple[int, int]]:
        """``{name: (offset, size)}`` in the message's order."""
        out, offset = {}, 0
        for name, size in (("timing", self.timing), ("waiting", 1), ("short", self.ranks), ("cap", self.ranks)):
            out[name] = (offset, size)
            offset += size
        return out

    @property
    def size(self) -> int:
        """The message's length in floats."""
        return self.timing + 1 + 2 * self.ranks

    def pack(self, rank: int, timing, waiting: bool = False, short: int = 0, cap: int = 0) -> list[float]:
        """This rank's message: its timings, its word and its two memory slots (zeros at the other ranks').

        Raises:
            ValueError: when ``timing`` has not the declared number of slots.
        """
        timing = [float(v) for v in timing]
        if len(timing) != self.timing:
            raise ValueError(f"a step's timing has {self.timing} slots; received {len(timing)}")
        slots = [0.0] * (2 * self.ranks)
        slots[rank] = float(short)
        slots[self.ranks + rank] = float(cap)
        return [*timing, 1.0 if waiting else 0.0, *slots]

    def read(self, tail) -> Read:
        """The summed message (the last :attr:`size` values of a step's sum), by section.

        Raises:
            ValueError: when ``tail`` is not :attr:`size` long.
        """
        values = [float(v) for v in tail]
        if len(values) != self.size:
            raise ValueError(f"a step's message has {self.size} values; received {len(values)}")
        parts = {name: values[offset : offset + size] for name, (offset, size) in self.sections.items()}
        return Read(parts["timing"], parts["waiting"][0] > 0, [round(v) for v in parts["short"]],
                    [round(v) for v in parts["cap"]])
