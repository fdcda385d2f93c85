"""Where the time goes: per-step timing of data, compute and waiting.

For each training step a rank records

* **data**: time between the end of its previous step and the start of this
  one (the input pipeline, plus Keras's own per-step work);
* **compute**: from the start of the step until its last gradient is
  accumulated (a post-accumulate hook on every weight: DDP's all-reduces run
  asynchronously during the backward pass and are waited for only after the
  last gradient), plus the optimizer update;
* **wait**: the rest of the step: communication that did not overlap, and
  waiting for slower devices (imbalance).

The rebalancer uses compute time per sample as each device's speed; the
report shows the three shares per device.
"""

from __future__ import annotations

import time

__all__ = ["StepTiming"]


class StepTiming:
    """Accumulates one rank's step timings (a window and an epoch)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.grad_done: float | None = None
        self.last_end: float | None = None
        self.reset_window()
        self.reset_epoch()

    def reset_window(self) -> None:
        self.window_compute = 0.0
        self.window_samples = 0
        self.window_steps = 0

    def reset_epoch(self) -> None:
        self.epoch = {"data": 0.0, "compute": 0.0, "wait": 0.0, "samples": 0, "steps": 0}

    def mark_grad(self, *_: object) -> None:
        """Called by the post-accumulate-grad hooks."""
        self.grad_done = time.perf_counter()

    def record(self, start: float, compute_end: float, optimizer_seconds: float, end: float, samples: int) -> None:
        data = 0.0 if self.last_end is None else max(0.0, start - self.last_end)
        compute = max(0.0, compute_end - start) + optimizer_seconds
        wait = max(0.0, (end - start) - compute)
        self.window_compute += compute
        self.window_samples += samples
        self.window_steps += 1
        e = self.epoch
        e["data"] += data
        e["compute"] += compute
        e["wait"] += wait
        e["samples"] += samples
        e["steps"] += 1

    def step_ended(self) -> None:
        self.last_end = time.perf_counter()


def format_report(report: dict) -> str:
    """The per-device breakdown as a small table."""
    lines = [f"multigpu: where the time went in epoch {report['epoch'] + 1}:",
             f"  {'device':<12}{'share':>7}{'data':>7}{'compute':>9}{'waiting':>9}{'samples/s':>11}"]
    for row in report["devices"]:
        total = row["data"] + row["compute"] + row["wait"] or 1.0
        lines.append(
            f"  {row['device']:<12}{row['share']:>7.0%}{row['data'] / total:>7.0%}"
            f"{row['compute'] / total:>9.0%}{row['wait'] / total:>9.0%}{row['samples_per_second']:>11.1f}"
        )
    return "\n".join(lines)
