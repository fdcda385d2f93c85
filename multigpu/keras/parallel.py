"""One parallel model: the parts multigpu keeps for it, and how they reach the model.

:class:`ParallelModel` holds the run's collectives, the model's load balancer
(the one owner of its shares), its step timing, its steps (the backend's,
handed in by :func:`multigpu.parallelize`) and its loops, and gives the model instance the methods that use them
(``fit``, ``evaluate``, ``predict``, the ``*_on_batch`` methods, the steps,
``get_metrics_result``, ``reset_metrics``, ``save``, ``save_weights``,
``export``, ``summary``).  The class is untouched, so the model stays the user's model: a
saved file is a plain Keras file.  On one device nothing is set at all.

:func:`state` is the public way to read a model's run: devices, current
shares, measured speeds, the last per-device report.
"""

from __future__ import annotations

import builtins
import os
import weakref
from dataclasses import dataclass, field

from multigpu import membership
from multigpu._keras.ledger import Ledger
from multigpu.balancing.balancer import LoadBalancer
from multigpu.balancing.profiles import model_signature
from multigpu.balancing.timing import StepTiming
from multigpu.data import readers as input_readers
from multigpu.keras.loops import Loops
from multigpu.keras.own_loops import as_class, base_methods, hand_over
from multigpu.keras.saving import atomic_save, route_public_saving
from multigpu.planning.shares import capped_split

__all__ = ["ParallelModel", "State", "register_single", "state", "unparallelize"]

_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KERAS_METHODS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch", "save",
                  "save_weights", "export", "summary", "get_weights", "set_weights", "load_weights")


@dataclass(frozen=True)
class Options:
    """Choices of ``parallelize`` that are not about shares."""

    sync_batchnorm: bool = False
    compression: str | None = None
    overlap: bool | None = None  # torch: sums during the backward pass (None: chosen by the devices and links)
    bucket_mb: float | None = None  # torch: the overlapped sums' bucket size in MiB (None: 4)
    shard_optimizer: bool = False  # each rank holds and updates the optimizer state of a part of the weights
    # (resolved by parallelize: None becomes what the transport chose)
    shard_gradients: bool = False  # torch: the built-in step's gradients go into the sum's buffer, not kept
    shard_weights: bool = False  # torch: each rank holds its part of the weights while fit runs
    shard_by_default: bool = False  # the optimizer state in parts by default: whole again where it holds none
    replay: bool | None = None  # torch: False keeps Keras's own forward pass at every step


@dataclass(frozen=True)
class State:
    """What a parallel model's run looks like now (read with :func:`multigpu.state`).

    Attributes:
        rank: this process's rank.
        world_size: the number of devices.
        devices: every rank's device.
        ratios: the current shares, as fractions of the global batch.
        speeds: the last measured samples/s of each device (compute only), if any.
        last_report: the last epoch's per-device breakdown (``report=True`` prints it), if any: per device,
            seconds waiting for ``input``, outside the step in all (``data``: input and Keras's loop),
            computing (``compute``) and waiting for other devices (``wait``).
        transport: how gradients are summed: ``"shm"``, ``"gloo"``, ``"nccl"`` or ``"none"`` (one device).
        caps: the per-device largest local batch, if given.
        quantum: local batch sizes are multiples of this many rows (JAX's automatic shares: 1/16 of the batch).
        overlap: whether the last training step summed its gradients in buckets while its backward pass ran
            (torch, between machines or on GPUs; see ``MULTIGPU_OVERLAP``).
        lost: the devices lost during the run, oldest first: ``rank``, ``device``, ``why`` and ``at`` (Unix
            time) each; their share is 0 until they come back.
        joined: the lost devices that came back (``--max-restarts``), oldest first: ``rank``, ``device`` and
            ``at`` each.
        shard_optimizer: whether each device holds the optimizer state of a part of the weights only.
        shard: how much of the training state is in parts: ``"weights"`` (and the gradients and the optimizer
            state), ``"gradients"`` (and the optimizer state), ``"optimizer"``, or ``None``.
        aside: the ranks whose devices are set aside now (automatic shares: they do not pay at this model and
            batch; the balancing guide).
        judgment: the last judgment of whether the devices pay (from a ``fit``'s second epoch, automatic shares),
            if any: ``device`` (the one judged alone, which stays: the fastest alone, rank 0's unless another's
            beats it by 10%), ``alone`` (its estimated samples/s alone, a floor),
            ``ceiling`` (its rows alone with no fixed work), ``together`` (the devices' best samples/s together in
            the fit), ``pays``, ``trial`` (set aside to measure: the floor and the ceiling straddle the together
            figure) and ``set_aside`` (the devices set aside for it; after a trial alone that ran slower, empty
            again, with ``alone_ran`` and ``pays`` true); where a group of devices stays (three or more),
            ``devices`` names it, ``device`` is its first and ``alone`` its estimate without the rest.
    """

    rank: int
    world_size: int
    devices: list
    ratios: list[float]
    speeds: list[float] | None = None
    last_report: dict | None = None
    transport: str = "none"
    caps: list[int | None] | None = field(default=None)
    quantum: int = 1
    overlap: bool = False
    lost: list[dict] = field(default_factory=list)
    joined: list[dict] = field(default_factory=list)
    shard_optimizer: bool = False
    shard: str | None = None
    aside: list[int] = field(default_factory=list)
    judgment: dict | None = None

    def shares(self, batch_size: int) -> list[int]:
        """Rows per device of a global batch of ``batch_size`` rows."""
        return capped_split(batch_size, self.ratios, self.caps, self.quantum)

    def describe(self) -> str:
        """One line naming the devices and their current shares."""
        parts = [f"{d.label} {r:.0%}" for d, r in zip(self.devices, self.ratios)]
        return f"multigpu: {self.world_size} device(s): " + ", ".join(parts)


class ParallelModel:
    """The parts of one parallel model (see the module docstring).

    Args:
        model: the user's Keras model.
        runtime: the run.
        comm: the run's collectives.
        balancer: the model's load balancer.
        options: the other choices of ``parallelize``.
        steps: the backend's steps class (``Steps(parallel_model)``: see :mod:`multigpu.backend`).
    """

    def __init__(self, model, runtime, comm, balancer: LoadBalancer, options: Options, steps) -> None:
        self.model = model
        self.runtime = runtime
        self.comm = comm
        self.balancer = balancer
        self.options = options
        self.steps_per_epoch: int | None = None
        self.timing = StepTiming(runtime.rank, runtime.world_size)
        self.ledger = Ledger()  # every attribute set on the model's Keras objects, with what was there
        self._saving_route = None
        cls = type(model)
        self.keras = {name: getattr(cls, name).__get__(model, cls) for name in _KERAS_METHODS}
        self.keras.update(base_methods(model))  # the loops call Keras's own; a class's own come first
        export = self.keras["export"]  # Keras's export takes no ``overwrite``: it replaces what is there
        self.keras["export_folder"] = lambda path, overwrite=True, **kw: export(path, **kw)
        self.steps = steps(self)
        self.loops = Loops(self)
        self.lost: list[dict] = []
        self.joined: list[dict] = []
        self.position = {"seed": 0, "epoch": 0, "step": 0}  # of the training data in fit: a returning rank's start
        method = weakref.WeakMethod(self._regrouped)
        comm.on_regroup(lambda members: method() and method()(members))

    def _regrouped(self, members) -> None:
        """A new group: a lost rank's shares go to the others from the next plan on (the step plans its batch
        again); ranks that came back get theirs when they are welcomed (:mod:`multigpu.backend.recovery`)."""
        self.lost = [dict(e) for e in members.lost]
        self.joined = [dict(e) for e in members.joined]
        out = [r for r in range(self.runtime.world_size) if r not in members.members]
        self.balancer.drop(out)
        input_readers.lose(out)  # inputs read once per machine: the lost ranks' part of the reading

    def signature(self) -> str:
        """The model's profile signature."""
        return model_signature(self.model)

    def install(self) -> None:
        """Gives the model instance its parallel methods (its class is untouched)."""
        methods = {
            **self.steps.methods(), **self.loops.methods(),
            "save": lambda filepath, overwrite=True, **kw: self.save("save", filepath, overwrite, **kw),
            "save_weights": lambda filepath, overwrite=True, **kw: self.save("save_weights", filepath, overwrite,
                                                                             **kw),
            "export": self.export,
            "summary": self.summary,
            "get_weights": self.get_weights,
            "set_weights": lambda weights: self.whole("set_weights", weights),
            "load_weights": lambda filepath, *args, **kw: self.whole("load_weights", filepath, *args, **kw),
        }
        for name, method in methods.items():
            self.ledger.set(self.model, name, method)
        self._class = type(self.model)
        hand_over(self.model, self.loops.handed_over(), self.ledger)
        _MODELS[self.model] = self
        self._saving_route = route_public_saving(self.model, _is_parallel_model)

    def uninstall(self) -> None:
        """Puts back everything :meth:`install` and the steps set (in reverse order) and lets the saving route
        go: the model, its optimizers, its layers and ``keras.saving`` are Keras's own again (a sharded
        optimizer's whole state first gathered on every rank)."""
        self.steps.gather_optimizers()
        self.ledger.undo()
        _MODELS.pop(self.model, None)
        if self._saving_route is not None:
            self._saving_route()
            self._saving_route = None

    def save(self, method: str, filepath, overwrite: bool = True, **kwargs):
        """Keras's ``save``/``save_weights`` on rank 0, atomically; every rank returns once the file is there.

        When Keras refuses the call on rank 0 (a wrong extension, an unknown
        argument), every rank raises the same error.
        """
        self.steps.driver.aside.up_to_date()  # (the leader set aside: the state trained elsewhere first)
        while True:
            leader = self.comm.leader
            error: Exception | None = None
            result = None
            membership.at("save", self.runtime.rank)
            try:
                with as_class(self.model, self._class), self.steps.whole_optimizers():  # Keras writes the
                    # name of the model's own class, and the whole optimizer state where it is sharded
                    result = atomic_save(self.keras[method], filepath, self.runtime.rank - leader, overwrite,
                                         **kwargs)
            except Exception as exc:
                error = exc
            failed = self.comm.sum_floats([1.0 if error is not None else 0.0],
                                          f"waiting for rank {leader} to write {os.fspath(filepath)!r}")[0]
            if self.comm.leader == leader:
                break  # else the writer was lost: the next rank writes it
        if failed:
            described = self.comm.gather_objects(
                None if error is None else (type(error).__name__, str(error)), "sharing a saving error")
            if error is not None:
                raise error
            name, message = next(d for d in described if d is not None)
            kind = getattr(builtins, name, None)
            raise (kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError)(message)
        return result

    def get_weights(self) -> list:
        """Keras's ``get_weights``; with the weights in parts (``shard="weights"``) a collective that gathers them:
        every rank calls it."""
        return self.whole("get_weights")

    def whole(self, method: str, *args, **kwargs):
        """Keras's ``method`` on the whole weights: with the weights in parts, gathered for the call (a collective:
        every rank calls it; what a load writes into the others' parts is let go after it)."""
        with self.steps.whole_weights():
            return self.keras[method](*args, **kwargs)

    def export(self, filepath, format: str = "tf_saved_model", **kwargs):
        """Keras's ``export`` (a SavedModel by default) on rank 0, atomically; every rank returns once it is there."""
        return self.save("export_folder", filepath, True, format=format, **kwargs)

    def summary(self, *args, **kwargs):
        """The model's own summary (rank 0 only) and one line with the devices and current shares."""
        if self.runtime.rank != 0:
            return None
        result = self.keras["summary"](*args, **kwargs)
        (kwargs.get("print_fn") or print)(self.balancer.describe())
        return result

    def state(self) -> State:
        b = self.balancer
        total = sum(b.ratios)
        transport = self.comm.transport
        if transport == "gloo" and all(d.is_cuda for d in self.runtime.devices):
            transport = "nccl"
        return State(self.runtime.rank, self.runtime.world_size, list(self.runtime.devices),
                     [r / total for r in b.ratios], b.speeds, b.last_report, transport, b.options.caps,
                     b.quantum, self.steps.overlapping, list(self.lost),
                     list(self.joined), self.options.shard_optimizer,
                     "weights" if self.options.shard_weights else
                     "gradients" if self.options.shard_gradients else
                     "optimizer" if self.options.shard_optimizer else None,
                     list(b.parking.parked), None if b.parking.judgment is None else dict(b.parking.judgment))


def _is_parallel_model(model) -> bool:
    """True for a model parallelized over several devices."""
    try:
        return isinstance(_MODELS.get(model), ParallelModel)
    except TypeError:  # pragma: no cover - not weak-referenceable
        return False


def register_single(model, runtime) -> None:
    """Remembers a model parallelized on one device (nothing of it is changed)."""
    _MODELS[model] = State(0, 1, list(runtime.devices), [1.0])


def unparallelize(model):
    """Turns a parallel model back into a plain Keras model, in place; returns it.

    Every attribute multigpu set on the model, its optimizers, its layers and
    callbacks is put back (newest first), and ``keras.saving`` is Keras's own
    again once no parallel model is left.  The model keeps its weights and
    optimizer state (the same on every rank) and trains on this process's
    device alone, as it would without multigpu; the run's processes and group
    stay for other parallel models.

    Raises:
        ValueError: when ``model`` was not parallelized.
    """
    entry = _entry(model, "unparallelize")
    if isinstance(entry, ParallelModel):
        entry.uninstall()
    else:
        _MODELS.pop(model, None)
    return model


def _entry(model, what: str):
    """What is kept for a parallelized ``model``; raises, naming ``multigpu.<what>()``, for any other."""
    entry = _MODELS.get(model) if is_parallel(model) else None
    if entry is None:
        raise ValueError(f"multigpu.{what}() takes a model returned by multigpu.parallelize(). "
                         f"Received: a {type(model).__name__} that was not parallelized")
    return entry


def is_parallel(model) -> bool:
    """True when ``parallelize`` was called on ``model``."""
    try:
        return model in _MODELS
    except TypeError:  # pragma: no cover - unhashable
        return False


def state(model) -> State:
    """The run of a parallelized model: devices, current shares, speeds, last report.

    Args:
        model: a model returned by ``multigpu.parallelize``.

    Returns:
        A :class:`State` snapshot.

    Raises:
        ValueError: when ``model`` was not parallelized.
    """
    entry = _entry(model, "state")
    return entry if isinstance(entry, State) else entry.state()

