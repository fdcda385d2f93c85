"""The share search's thresholds, in one frozen object (:class:`multigpu.balancing.search.ShareSearch` reads them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Tuning"]


@dataclass(frozen=True)
class Tuning:
    """The search's thresholds, in one place (relative figures are fractions of a throughput).

    Attributes:
        quiet_noise: the noise assumed until two differences of windows are measured.
        noise_windows: how many recent differences of windows the noise is the median of.
        target_noise: a measurement is averaged over windows until its noise is about this.
        max_window_factor: the longest measurement, in standard windows.
        margin_noise: a move pays when it beats the kept shares by this many noise units
            (and by ``noise_floor``).
        base_windows: how many recent windows at the kept shares make their figure.
        shift: the kept shares ran far from before when their figure moved by this
            much, or by ``shift_noise`` noise units if more.
        shift_noise: see ``shift``.
        jump_imbalance: jump to the shares the speeds call for when they are this far
            out of balance (``1 + max(jump_imbalance, jump_noise * noise)``).
        jump_noise: see ``jump_imbalance``; 0: the compute speeds compare the devices within the same steps,
            so the throughput's noise between windows says nothing of theirs (a jump is judged by throughput
            like any move; at 3 noise units, short fits on a noisy machine never jumped and stayed at the
            calibrated shares, which miss a step's fixed work on the slow device).
        max_jumps: jumps per search.
        strict_factor: the best of the scan must beat the kept shares by this many margins.
        growth: after a kept move, the next one is this many times larger (up to ``max_step``).
        drop: once settled, a throughput drop of this much (or ``drop_noise`` noise units) is an alarm.
        drop_noise: see ``drop``.
        alarms: alarms in a row that start the search again.
        watched: how many recent windows at the settled shares make the reference.
        tie_imbalance: when the search settles with the compute speeds this far out of balance
            (``1 + tie_imbalance``), it settles instead at the measured shares nearest their
            balance whose throughput was within ``tie_noise`` noise units of the kept shares'.
        tie_noise: see ``tie_imbalance``.
        away_imbalance: a move whose windows leave the compute times further out of balance than the kept
            shares' and beyond ``1 + away_imbalance`` must win by ``strict_factor`` margins.
        off_grid_gain: settled on a grid of sizes, the search takes the speeds' balance between two of its
            sizes where the speeds say it shortens the step by at least this fraction (one size more, never
            probed: its gain is below what a window can tell).
        fit_gain: when the search's steps are spent, it settles at the fitted step costs' best shares between
            the kept ones and the nearest measured beyond them where those shorten the expected step by at
            least this fraction (:meth:`~multigpu.balancing.settling.Settling._interpolate`).
    """

    quiet_noise: float = 0.015
    noise_windows: int = 10
    target_noise: float = 0.025
    max_window_factor: int = 8
    margin_noise: float = 0.5
    base_windows: int = 3
    shift: float = 0.08
    shift_noise: float = 4.0
    jump_imbalance: float = 0.1
    jump_noise: float = 0.0
    max_jumps: int = 2
    strict_factor: float = 2.0
    growth: float = 1.5
    drop: float = 0.05
    drop_noise: float = 3.0
    alarms: int = 3
    watched: int = 5
    tie_imbalance: float = 0.05
    tie_noise: float = 1.0
    away_imbalance: float = 0.05
    off_grid_gain: float = 0.01
    fit_gain: float = 0.02
