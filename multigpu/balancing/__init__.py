"""Load balancing: who owns the shares (``balancer``), how they are searched (``search``),
kept between runs (``profiles``) and measured (``timing``)."""

from multigpu.balancing.balancer import BalanceOptions, LoadBalancer, describe_shares
from multigpu.balancing.search import ShareSearch
from multigpu.balancing.timing import StepRecord, StepTiming
from multigpu.balancing.windows import Event, Window, balance_efficiency

__all__ = [
    "BalanceOptions",
    "Event",
    "LoadBalancer",
    "ShareSearch",
    "StepRecord",
    "StepTiming",
    "Window",
    "balance_efficiency",
    "describe_shares",
]
