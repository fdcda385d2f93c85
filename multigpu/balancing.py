"""Load balancing inside a run: calibration, online rebalancing, reports.

A mixin of :class:`multigpu.trainer.ParallelState`, kept apart so that the
Keras integration reads on its own.  The maths is in :mod:`multigpu.balance`
(pure Python), the measurements in :mod:`multigpu.calibrate` and
:mod:`multigpu.timing`.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from multigpu.balance import Rebalancer
from multigpu.calibrate import (
    ProfileError,
    default_profile_path,
    model_signature,
    profile_key,
    read_profile,
    solo_speed,
    write_profile,
)
from multigpu.timing import format_report

__all__ = ["BalancingMixin"]


class BalancingMixin:
    """Calibration, rebalancing and timing reports for a ``ParallelState``."""

    def _log(self, message: str) -> None:
        if self.rank == 0:
            print(f"multigpu: {message}", flush=True)

    def _describe_shares(self, ratios) -> str:
        total = sum(ratios)
        return "/".join(f"{r / total:.0%}" for r in ratios)

    def _calibrate(self, x, y, sample_weight, local: int) -> None:
        """Sets the ratios from a profile, or from solo steps on every rank."""
        self.calibrated = True
        specs = [d.spec for d in self.runtime.devices]
        key = profile_key(model_signature(self.model), specs)
        path = self.profile or default_profile_path()
        if not self.recalibrate:
            try:
                entry = read_profile(path, key, specs)
            except ProfileError as exc:
                entry = None
                if Path(path).exists() and self.rank == 0:
                    warnings.warn(f"multigpu: cannot use the profile ({exc}); calibrating instead.", stacklevel=2)
            if entry is not None:
                self.ratios = [float(r) for r in entry["ratios"]]
                self.speeds = entry.get("speeds")
                self._log(f"shares {self._describe_shares(self.ratios)} from the profile {path}")
                self._start_rebalancer()
                return
        speed, spent = solo_speed(self.model, x, y, sample_weight)
        vec = torch.zeros(2 * self.runtime.world_size, dtype=torch.float64, device=self.runtime.torch_device)
        vec[self.rank] = speed
        vec[self.runtime.world_size + self.rank] = spent
        dist.all_reduce(vec)
        speeds = vec[: self.runtime.world_size].tolist()
        spent = max(vec[self.runtime.world_size :].tolist())
        if all(v > 0 for v in speeds):
            self.ratios = [v / sum(speeds) for v in speeds]
            self.speeds = speeds
        steps = self._steps_per_epoch or 1
        epoch_estimate = steps * (self._batch_size or local) / max(sum(v for v in speeds if v > 0), 1e-9)
        detail = ", ".join(f"{d.label} {v:.0f} samples/s" for d, v in zip(self.runtime.devices, speeds))
        self._log(
            f"calibrated in {spent:.1f} s ({spent / max(epoch_estimate, 1e-9):.1%} of an epoch): "
            f"{detail} -> shares {self._describe_shares(self.ratios)}"
        )
        self._start_rebalancer()
        self._save_profile(path, key, specs)

    def _start_rebalancer(self) -> None:
        if not self.rebalance:
            return
        # The calibration's speeds only set the starting shares; they are not
        # the rebalancer's prior: they were measured at the candidate shares
        # (equal, say), and per-sample speed depends on the local batch, so
        # the first window measured at the new shares replaces them outright.
        self.rebalancer = Rebalancer(list(self.ratios), batch_size=self._batch_size or 1, caps=self.caps)
        # A window of at least ~2 s of steps (the same on every rank: it
        # comes from the all-reduced speeds), and at least 5 steps: shorter
        # windows measure scheduler noise (a CPU quota's 100 ms period, say).
        step_seconds = (self._batch_size or 1) / max(sum(self.speeds or [1.0]), 1e-9)
        self.rebalance_every = int(min(50, max(5, 2.0 / max(step_seconds, 1e-6))))
        self.timing.reset_window()

    def _rebalance(self) -> None:
        n = self.runtime.world_size
        vec = torch.zeros(2 * n, dtype=torch.float64, device=self.runtime.torch_device)
        vec[self.rank] = self.timing.window_compute
        vec[n + self.rank] = self.timing.window_samples
        dist.all_reduce(vec)
        self.timing.reset_window()
        old = list(self.ratios)
        if self.rebalancer.observe(vec[:n].tolist(), [int(v) for v in vec[n:].tolist()]):
            self.ratios = list(self.rebalancer.ratios)
            self.speeds = list(self.rebalancer.speeds)
            speeds = ", ".join(f"{d.label} {v:.0f}/s" for d, v in zip(self.runtime.devices, self.speeds))
            self._log(f"shares {self._describe_shares(old)} -> {self._describe_shares(self.ratios)} "
                      f"(measured compute speeds {speeds})")

    def _save_profile(self, path, key, specs) -> None:
        if self.rank != 0 or not self.speeds:
            return
        entry = {
            "devices": specs, "speeds": self.speeds, "ratios": self.ratios,
            "batch_size": self._batch_size, "model": self.model.name, "measured": time.time(),
        }
        try:
            write_profile(path, key, entry)
        except OSError as exc:
            warnings.warn(f"multigpu: could not write the profile {path}: {exc}", stacklevel=2)

    def epoch_report(self, epoch: int) -> dict:
        """Gathers every rank's epoch timings (a collective) and resets them."""
        n = self.runtime.world_size
        e = self.timing.epoch
        vec = torch.zeros(5 * n, dtype=torch.float64, device=self.runtime.torch_device)
        for i, k in enumerate(("data", "compute", "wait", "samples", "steps")):
            vec[i * n + self.rank] = e[k]
        dist.all_reduce(vec)
        self.timing.reset_epoch()
        rows = []
        for r, d in enumerate(self.runtime.devices):
            data, compute, wait, samples, steps = (vec[i * n + r].item() for i in range(5))
            total = data + compute + wait
            rows.append({
                "device": d.label, "share": self.ratios[r] / sum(self.ratios), "data": data,
                "compute": compute, "wait": wait, "samples": int(samples), "steps": int(steps),
                "samples_per_second": samples / total if total else 0.0,
                "compute_samples_per_second": samples / compute if compute else 0.0,
            })
        self.last_report = {"epoch": epoch, "devices": rows}
        if self.report and self.rank == 0:
            print(format_report(self.last_report), flush=True)
        return self.last_report
