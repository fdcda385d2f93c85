"""Planning: ratios, integer shares of a batch, and step plans (pure Python, no framework import)."""

from multigpu.planning.plan import StepPlan, StepPlanner, epoch_plan, num_steps
from multigpu.planning.shares import (
    RatioSpec,
    capped_split,
    parse_ratios,
    predicted_step_time,
    split,
    validate_ratios,
)

__all__ = [
    "RatioSpec",
    "StepPlan",
    "StepPlanner",
    "capped_split",
    "epoch_plan",
    "num_steps",
    "parse_ratios",
    "predicted_step_time",
    "split",
    "validate_ratios",
]
