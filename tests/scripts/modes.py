"""What the scripts that run several modes against one plain process share (``keras_features.py``,
``tensorflow_steps.py``, ``sharded.py``): the arguments, the parallel model, the per-rank result files.

    python SCRIPT.py MODES OUT [--plain] [--devices cpu:0,cpu:1] [--ratios 3,1]

MODES is a comma-separated list (or "all"); mode M writes OUT-M.npz (rank R > 0: OUT-M.npz.rankR.npz).
"""

import argparse
import json

import numpy as np


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("modes")
    p.add_argument("out")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--devices", default="cpu:0,cpu:1")
    p.add_argument("--ratios", default="3,1")
    return p


def run(modes: dict, a: argparse.Namespace) -> None:
    """Runs each mode asked for, each writing its own file."""
    base = a.out
    for mode in (modes if a.modes == "all" else a.modes.split(",")):
        a.out = f"{base}-{mode}.npz"
        modes[mode](a)


def parallel(model, a, timeout: float = 60, **kwargs):
    """``(model, rank)``: the model as given with ``--plain``, else parallelized on ``--devices`` at ``--ratios``."""
    if a.plain:
        return model, 0
    import multigpu

    ratios = [float(r) for r in a.ratios.split(",")] if a.ratios else None
    model = multigpu.parallelize(model, devices=a.devices.split(","), ratios=ratios, timeout=timeout, **kwargs)
    return model, multigpu.rank()


def save(a, rank: int, **arrays) -> None:
    """This rank's results of the mode (lists and dicts as JSON)."""
    path = a.out if rank == 0 else f"{a.out}.rank{rank}.npz"
    np.savez(path, **{k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in arrays.items()})
