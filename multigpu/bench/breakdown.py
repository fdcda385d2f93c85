"""Where one training step's time goes: phase timers for a benchmark process.

:func:`install` wraps, in this process only, the calls a Keras training step
makes — the step itself, the model's forward pass, the loss, ``backward``,
the optimizer's own update, the metrics, and (on a parallel model) the
collective that sums gradients — with timers.  It works the same on a plain
Keras model and on a parallel one, so the two can be compared phase by
phase.  Whatever is inside the step but in no phase is multigpu's (or
Keras's) own work around them; whatever is outside the step is Keras's loop,
the data and the callbacks.

Timers cost about a microsecond per call; the benchmark that uses them
(``benchmarks/bench_overhead.py``) compares runs that all carry them.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

__all__ = ["PHASES", "Breakdown", "install"]

PHASES = ("forward", "loss", "backward", "sum gradients", "optimizer", "metrics")


class Breakdown:
    """Seconds spent in each phase, and in the training step, since :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth: dict[str, int] = defaultdict(int)
        self.steps = 0

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def timed(self, phase: str, fn):
        """``fn`` counting its time under ``phase`` (outermost call only, so recursion counts once)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.depth[phase]:
                return fn(*args, **kwargs)
            self.depth[phase] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
                self.depth[phase] -= 1

        return wrapper

    def per_step_ms(self, wall_seconds: float) -> dict[str, float]:
        """Milliseconds per step of each phase, the rest of the step, and the loop outside it."""
        n = max(1, self.steps)
        out = {p: 1e3 * self.seconds.get(p, 0.0) / n for p in PHASES}
        step = 1e3 * self.seconds.get("step", 0.0) / n
        out["rest of the step"] = max(0.0, step - sum(out.values()))
        out["Keras loop, data, callbacks"] = max(0.0, 1e3 * wall_seconds / n - step)
        out["wall"] = 1e3 * wall_seconds / n
        return out


def install(model) -> Breakdown:
    """Puts phase timers on ``model`` (plain or parallel) and on this process's torch and Keras calls.

    Call it after ``parallelize`` and ``compile``, before ``fit``.  On TensorFlow the step is one traced
    function: its forward pass, loss, ``backward``, update and metrics run inside it and are not told apart
    (:func:`_install_tensorflow`).
    """
    from multigpu import env

    if env.keras_backend() == "tensorflow":
        return _install_tensorflow(model)
    import torch

    from multigpu._keras import compat as _compat

    b = Breakdown()
    step = model.train_step  # the instance's (parallel) or the class's (plain)

    def train_step(*args, **kwargs):
        b.steps += 1
        return timed_step(*args, **kwargs)

    timed_step = b.timed("step", step)
    object.__setattr__(model, "train_step", train_step)
    object.__setattr__(model, "call", b.timed("forward", model.call))
    _compat.wrap_compute_loss(model, functools.partial(b.timed, "loss"))
    object.__setattr__(model, "compute_metrics", b.timed("metrics", model.compute_metrics))
    torch.Tensor.backward = b.timed("backward", torch.Tensor.backward)
    cls = type(model.optimizer)
    # The class's update: a parallel model's wrapper sums the gradients first, then calls this one.
    cls.apply = b.timed("optimizer", cls.apply)
    try:
        from multigpu.engine.comm import Comm
    except ImportError:  # pragma: no cover - torch is always there on this backend
        return b
    Comm.reduce = b.timed("sum gradients", Comm.reduce)
    from multigpu.backend.torch.replay import ForwardReplay

    # A replayed forward pass runs the loss's operations too: "forward" then holds both.
    ForwardReplay._replay = b.timed("forward", ForwardReplay._replay)
    return b


def _install_tensorflow(model) -> Breakdown:
    """Phase timers for a TensorFlow model: the training function Keras's loop calls (the step), the sum of the
    gradients over ranks (``sum gradients``: the host callback inside the step) and, with the optimizer state
    in parts, the exchange of the new weights (``optimizer``).  What the traced function computes (forward,
    loss, backward, update, metrics) is the rest of the step."""
    b = Breakdown()
    make = model.make_train_function

    def make_train_function(force: bool = False):
        function = make(force)
        function = model.train_function if function is None else function  # (Keras's own sets it, returns None)
        if getattr(function, "_timed", False):
            return function
        timed = b.timed("step", function)

        def train_function(*args, **kwargs):
            b.steps += 1
            return timed(*args, **kwargs)

        train_function._timed = True
        object.__setattr__(model, "train_function", train_function)
        return train_function

    object.__setattr__(model, "make_train_function", make_train_function)
    from multigpu.backend.tensorflow.collectives import Comm

    Comm.reduce = b.timed("sum gradients", Comm.reduce)
    Comm.gather_parts = b.timed("optimizer", Comm.gather_parts)
    return b
