"""What the user asked of the load balancer (``parallelize``'s arguments about shares), in one object."""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.planning.shares import RatioSpec

__all__ = ["BalanceOptions"]


@dataclass
class BalanceOptions:
    """What the user asked of the balancer (see ``parallelize``).

    Attributes:
        spec: the ratios as given.
        auto: measure and move shares (``ratios="auto"``, or devices that differ).
        rebalance: move shares while training.
        profile: the profile file, or None for the default.
        recalibrate: measure even when the profile has an entry.
        caps: per-device largest local batch.
        report: print the per-device breakdown at each epoch end.
        grid: with automatic shares, local batch sizes are multiples of ``batch // grid`` rows, and the
            search's smallest move is that many rows (0: any size, moves down
            to one sample).  Where every new local batch size costs a
            compilation (JAX), a few sizes are compiled once each, and small
            moves would cost more than they can find.
        scan: open the search with a scan of far shares (see
            :class:`~multigpu.balancing.search.ShareSearch`); off where each
            new local batch size compiles (JAX).
        off_grid: settled, the search may take one size off the grid (:meth:`~multigpu.balancing.settling.
            Settling._off_grid`; TensorFlow, where a new size is a trace of a fraction of a second).
        compression: how gradients travel (``None``: exact float32), for the advice on slow links.
    """

    spec: RatioSpec
    auto: bool
    rebalance: bool
    profile: str | None = None
    recalibrate: bool = False
    caps: list[int | None] | None = None
    report: bool = False
    grid: int = 0
    scan: bool = True
    off_grid: bool = False
    compression: str | None = None
