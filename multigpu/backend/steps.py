"""What every backend's steps do, and the part they share.

A backend's ``Steps(parallel_model)`` is the one object between Keras's loops
and the backend's collectives for one parallel model.  The contract, which
:class:`multigpu.keras.parallel.ParallelModel` and its loops and callbacks
rely on:

* ``methods()``: the methods the model *instance* gets (its class is
  untouched): the training, test and predict steps or functions Keras's loop
  calls, ``get_metrics_result`` (global results) and ``reset_metrics``;
* ``overlapping``: whether the last training step summed gradients while its
  backward pass ran;
* ``realign_replicas()`` and ``sync_batchnorm_statistics()`` at every epoch's
  end (``multigpu.keras.callbacks.EpochHooks``);
* with a sharded optimizer (``shard_optimizer=True``, where the backend's
  facts allow it): ``prepare_optimizers()`` when ``fit`` starts (each rank
  builds the state of its own part only), ``whole_optimizers()`` around a
  save (the whole state on every rank), ``gather_optimizers()`` before the
  model is made plain again.

Inside a training step, in this order, on every rank: the plan of the global
batch is taken (this rank's rows and gradient weight ``b_r / B``,
:mod:`multigpu.planning.plan`); the first step calibrates when shares are
automatic; the gradients times ``b_r / B`` are summed over ranks together
with the metric states and the step's timings; the balancer reads the timings.

:class:`StepsCore` holds what is the same on every backend: the first-use
initialisation (rank 0's weights everywhere, a different random stream per
rank), the calibration call, the realignment of replicas that run on
different kinds of processor, and, for a backend whose collectives take
NumPy arrays, the variable transfers and the epoch-end BatchNorm average
(torch's steps have their own).  A backend implements its steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import keras
import numpy as np

from multigpu import backend, membership
from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import batchnorm_statistics, optimizer_slots, optimizers_of, own_method
from multigpu.backend import parking
from multigpu.backend.recovery import RecoveryHooks
from multigpu.backend.sharding import holds_nothing
from multigpu.balancing.caps import is_out_of_memory
from multigpu.planning.footprint import Footprint
from multigpu.planning.partition import memory_weights, owners

__all__ = ["SEED_STRIDE", "StepsCore", "time_alone"]

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
BROADCAST_BYTES = 16 << 20  # a broadcast of variables sends about this many bytes at a time


def _nbytes(variable) -> int:
    return int(np.prod(variable.shape)) * _ITEMSIZE.get(keras.backend.standardize_dtype(variable.dtype), 4)

SEED_STRIDE = 1_000_003  # rank r's seed variables are offset by r times this: Dropout draws differ per rank


def time_alone(call: Callable[[], object], rows: int, *, first: Callable[[], object] | None = None, warmup: int = 0,
               min_steps: int = 2, min_seconds: float = 1.0, max_steps: int = 30) -> tuple[float, float]:
    """Samples/s of this rank's share of the step alone, as calibration measures it on every backend.

    Args:
        call: one pass over ``rows`` rows; one that returns ``False`` is not counted (torch: a pass that was
            recorded for replay, not replayed).
        rows: the rows of each pass.
        first: an untimed first pass (a compilation, a trace), if any.
        warmup: how many of the first calls are not counted.
        min_steps: at least this many counted passes...
        min_seconds: ...taking at least this long in all,
        max_steps: or this many counted passes, whichever comes first.

    Returns:
        The samples/s of the counted passes, and the seconds the whole measurement took.
    """
    began = time.perf_counter()
    if first is not None:
        first()
    timed: list[float] = []
    calls = 0
    while True:
        t0 = time.perf_counter()
        counted = call() is not False
        calls += 1
        if calls > warmup and counted:
            timed.append(time.perf_counter() - t0)
        if (len(timed) >= min_steps and sum(timed) >= min_seconds) or calls >= max_steps + warmup:
            break
    return rows * len(timed) / max(sum(timed), 1e-9), time.perf_counter() - began


class StepsCore(RecoveryHooks):
    """The backend-neutral part of a parallel model's steps (see the module docstring).

    Args:
        parallel: the model's :class:`~multigpu.keras.parallel.ParallelModel`.
    """

    def __init__(self, parallel) -> None:
        self.parallel = parallel
        self.model = parallel.model
        self.comm = parallel.comm
        self.timing = parallel.timing
        self.balancer = parallel.balancer
        cls = type(self.model)
        self.user_train_step = own_method(cls, "train_step")
        self.user_test_step = own_method(cls, "test_step")
        self.keras_metrics_result = keras.Model.get_metrics_result.__get__(self.model)  # Keras's own, local
        self.keras_reset_metrics = cls.reset_metrics.__get__(self.model)
        self._initialized = False
        self.shards = None  # the optimizers in parts (``shard_optimizer=True``), where the backend builds them
        self.memory = None  # the memory policy (balancing/caps.py's DeviceMemory), where the backend measures
        self._said_parts = False
        self._checked_state = False  # whether fit checked that the devices hold the training state
        self.balancer.parking.allowed = parking.allowed(self)  # devices that do not pay may be set aside
        self.balancer.parking.groups = self.balancer.parking.allowed and self.comm.sums_among  # (several left)

    # ---------------------------------------------------------- the contract
    def methods(self) -> dict:
        """What the model instance gets."""
        raise NotImplementedError

    @property
    def overlapping(self) -> bool:
        """Whether the last training step summed gradients during its backward pass."""
        return False

    def settle_parts(self) -> None:
        """When ``fit`` starts: the optimizer state that went in parts by default is whole again where parts
        would hold nothing (:func:`~multigpu.backend.sharding.holds_nothing`); every rank decides alike."""
        options = self.parallel.options
        if self.shards is not None and options.shard_by_default and holds_nothing(optimizers_of(self.model)):
            self.shards = None
            self.parallel.options = dataclasses.replace(options, shard_optimizer=False, shard_by_default=False)
            self.balancer.log(f"the optimizer state whole on each device: {type(self.model.optimizer).__name__} "
                              "keeps none per weight to put in parts")

    def prepare_optimizers(self) -> None:
        """Builds the optimizers before Keras would (an optimizer in parts: the state of this rank's part only)."""
        if self.shards is not None and self.model.optimizer is not None:
            self.see_optimizers()
            self.shards.prepare(self.model.optimizer, self.model.trainable_variables)
            if not self._said_parts:
                self._said_parts = True
                gradients = self.parallel.options.shard_gradients
                self.balancer.log(f"the optimizer state in parts{' and the gradients not kept' if gradients else ''}"
                                  ": each device holds and updates that of a part of the weights, by its memory"
                                  f"{', and writes its gradients into the sum as they are made' if gradients else ''}"
                                  " (shard_optimizer=False keeps a whole copy on each)")

    def check_state(self, skip: bool = False) -> None:
        """When ``fit`` starts, before the optimizers are built (a collective, once a model; ``skip``: a rank that
        came back, whose others checked before it was lost): where a device's memory is known (a GPU, a CPU
        device given a size), the run ends before its first step on every rank, with one error naming each
        device's memory and the level of ``shard`` that fits, when a device cannot hold what the first step
        adds to the training state (:meth:`multigpu.balancing.caps.DeviceMemory.check_state`)."""
        devices = self.comm.runtime.devices
        if (self._checked_state or self.memory is None or self.model.optimizer is None
                or not any(d.memory is not None or d.is_cuda for d in devices)):
            return
        self._checked_state = True
        if skip:
            return
        trainable = list(self.model.trainable_variables)
        sizes = [int(np.prod(v.shape)) for v in trainable]
        itemsizes = [_nbytes(v) // max(1, n) for v, n in zip(trainable, sizes)]
        weights = self.shards.weights if self.shards is not None else memory_weights([d.memory for d in devices])
        optimizer = self.model.optimizer
        footprint = Footprint.of(sizes, itemsizes, optimizer_slots(optimizer), owners(sizes, weights) if sizes else [],
                                 self.comm.world_size, optimizer.built)
        options, facts = self.parallel.options, backend.facts()
        level = ("weights" if getattr(options, "shard_weights", False) else "gradients" if options.shard_gradients
                 else "optimizer" if options.shard_optimizer else "whole")
        levels = ["whole"]
        if facts.shard_optimizer and getattr(self.comm, "min_devices", None) is None:
            levels.append("optimizer")
            if (facts.shard_gradients and options.compression is None and not options.sync_batchnorm
                    and not options.overlap):
                levels += ["gradients", "weights"] if facts.shard_weights else ["gradients"]
        self.memory.check_state(footprint, level, levels)

    def fit_ends(self) -> None:
        """At the end of ``fit`` (after its last epoch, on every rank): what held only during ``fit`` ends."""

    def steps_ahead(self, plan) -> int | None:
        """The steps of this ``fit`` left after this one at its local batch, where known (the shares settled, a
        whole global batch: a last, partial one comes once an epoch, and ``steps_per_epoch`` known); else None."""
        position, per_epoch = self.parallel.position, self.parallel.steps_per_epoch
        if (self.balancer.searching or plan.total != self.balancer.batch_size or not per_epoch
                or "epochs" not in position):
            return None
        return max(0, (position["epochs"] - position.get("epoch", 0)) * per_epoch - position.get("step", 0) - 1)

    def see_optimizers(self) -> None:
        """Takes in every optimizer of the model (once each): in parts, its update runs on the owned variables."""
        if self.shards is not None:
            for optimizer in optimizers_of(self.model):
                self.shards.see(optimizer)

    def whole_optimizers(self) -> contextlib.AbstractContextManager:
        """The optimizers' whole state on every rank for the time of the block (a collective: every rank)."""
        return self.shards.whole() if self.shards is not None else contextlib.nullcontext()

    def whole_weights(self) -> contextlib.AbstractContextManager:
        """Every weight on every rank for the time of the block (weights in parts: a collective, every rank)."""
        return contextlib.nullcontext()

    def gather_optimizers(self) -> None:
        """The optimizers' whole state on every rank from now on (a collective: every rank)."""
        if self.shards is not None:
            self.shards.gather()

    def sync_batchnorm_statistics(self) -> None:
        """BatchNorm moving statistics averaged over ranks, weighted by share (at an epoch's end).

        This and the two hooks below serve a backend whose ``Comm`` sums
        NumPy arrays (JAX, TensorFlow); torch's steps have their own.
        """
        variables = batchnorm_statistics(self.model)
        if not variables:
            return
        ratios = self.balancer.ratios
        weight = ratios[self.comm.rank] / sum(ratios)
        values = [np.asarray(v) for v in variables]
        vector = np.concatenate([a.reshape(-1).astype(np.float32) for a in values]) * np.float32(weight)
        summed = self.comm.reduce(vector, "averaging BatchNorm statistics")
        offset = 0
        for v, a in zip(variables, values):
            v.assign(summed[offset : offset + a.size].reshape(a.shape).astype(a.dtype))
            offset += a.size

    # ---------------------------------------------------------- backend hooks
    def _broadcast_variables(self, variables: Sequence, what: str, src: int | None = None) -> None:
        """Rank ``src``'s values of ``variables`` (Keras variables) on every rank (by default the leader's), a
        few at a time: the host copies it makes hold at most about :data:`BROADCAST_BYTES` beside a variable
        larger than that (not a second copy of the weights)."""
        variables = list(variables)
        start = 0
        while start < len(variables):
            end, size = start, 0
            while end < len(variables) and (end == start or size + _nbytes(variables[end]) <= BROADCAST_BYTES):
                size += _nbytes(variables[end])
                end += 1
            arrays = [np.asarray(v) for v in variables[start:end]]
            sent = self.comm.broadcast(arrays, what=what) if src is None else self.comm.broadcast(arrays, src, what)
            for v, value in zip(variables[start:end], sent):
                v.assign(value)
            start = end

    def _offset_seeds(self, variables: Sequence, offset: int) -> None:
        """Adds ``offset`` to the first element of each seed variable."""
        for v in variables:
            value = np.asarray(v).copy()
            value[0] = value[0] + np.asarray(offset).astype(value.dtype)
            v.assign(value)

    # ---------------------------------------------------------- shared
    def _state_variables(self, with_optimizers: bool = False) -> list:
        """The model's variables without metric states (and the optimizers' with ``with_optimizers``), once each."""
        metric_ids = {id(v) for m in self.model.metrics for v in m.variables}
        pool = list(self.model.variables)
        if with_optimizers:
            pool += [v for o in optimizers_of(self.model) for v in o.variables]
        unique = {id(v): v for v in pool if id(v) not in metric_ids}  # each variable once, in order
        return list(unique.values())

    # ------------------------------------------------ devices set aside (multigpu/backend/parking.py)
    def can_set_aside(self) -> bool:  # whether these steps can leave ranks out of their sums (every backend's can)
        return True

    def stand_still(self, logs):  # what a training step set aside returns, showing ``logs`` (backend/parking.py)
        return logs

    def logs_in(self, result):  # the logs in what a training ``attempt`` returned
        return result

    def forget_results(self) -> None:
        """The last step's global results forgotten: the next ``get_metrics_result`` sums over every rank."""

    def sum_over_all(self, every: bool) -> None:
        """The step's sums over every rank again (``every``), or over the ranks left only (devices set aside)."""

    # Keras's loop on JAX and TensorFlow calls functions the model makes: a backend's steps build them.
    initialize_when_made = False  # the first function made also initializes (rank 0's weights everywhere)

    def make_train_function(self, force: bool = False):
        """Keras's ``make_train_function``: the backend's training function, built once (again with ``force``)."""
        return self._made("train", force)

    def make_test_function(self, force: bool = False):
        """Keras's ``make_test_function``: the backend's test function, built once (again with ``force``)."""
        return self._made("test", force)

    def _made(self, kind: str, force: bool):
        """``self._<kind>_function``, set as the model's ``<kind>_function`` (``_build_<kind>`` first if needed)."""
        if self.initialize_when_made:
            self._initialize()
        if getattr(self, f"_{kind}") is None or force:
            getattr(self, f"_build_{kind}")()
        function = getattr(self, f"_{kind}_function")
        setattr(self.model, f"{kind}_function", function)
        return function

    def _initialize(self) -> None:
        """Rank 0's weights everywhere, and different random streams on every rank (once, at first use); on a
        rank that came back after a loss, the state the others send (:meth:`_welcome_state`)."""
        if self._initialized:
            return
        self._initialized = True
        if self.comm.rejoined:
            self._welcome_state()
            return
        seeds = _compat.seed_variables(self.model)
        self._broadcast_variables(self._state_variables(), "broadcasting the initial weights")
        self._offset_seeds(seeds, SEED_STRIDE * self.comm.rank)

    def _welcome_state(self, src: int | None = None) -> None:
        """Rank ``src``'s (by default the leader's) weights and optimizer state on every rank of a group that took
        in ranks coming back (their metric states start at 0: the global sums stay right), other random streams."""
        for optimizer in optimizers_of(self.model):
            if not optimizer.built:  # a rank that came back: Keras builds it at the first update, after this
                optimizer.build(self.model.trainable_variables)
        seeds = _compat.seed_variables(self.model)
        self._broadcast_variables(self._state_variables(with_optimizers=True),
                                  "sending the state to the ranks that came back", src=src)
        self._offset_seeds(seeds, SEED_STRIDE * (self.comm.rank - (self.comm.leader if src is None else src)))

    def restore_metrics(self) -> None:
        """This rank's metric states put back as :meth:`snapshot` kept them (a step taken again after an OOM)."""
        raise NotImplementedError(f"{type(self).__name__} does not take a step again")

    def lost_peer(self, exc: BaseException):
        """The :class:`~multigpu.membership.PeerLostError` that ``exc`` stands for, or None (the driver's
        question: a backend whose framework wraps errors unwraps it)."""
        return exc if isinstance(exc, membership.PeerLostError) else None

    def _calibrate_on(self, data, plan) -> None:
        """Sets automatic shares from each rank's samples/s alone on its rows of ``data`` (the backend's
        ``_solo_rate(data, rows)``); a rank with no rows, or a step of the model's own (its cost is its own: the
        search finds its shares), or a device that cannot hold its rows alone says 0 (the steps find its cap)."""
        def measured() -> tuple[float, float]:
            if plan.local == 0 or self.user_train_step is not None:
                return 0.0, 0.0
            try:
                return self._solo_rate(data, plan.local)
            except Exception as exc:
                if self.memory is None or not is_out_of_memory(exc):
                    raise
            self._release()
            return 0.0, 0.0

        self.balancer.calibrate(measured, lambda v: self.comm.sum_floats(v, "calibrating"),
                                self.parallel.steps_per_epoch)

    def _solo_rate(self, data, rows: int) -> tuple[float, float]:
        """Samples/s of this rank's forward and backward passes on its ``rows`` rows alone, and the seconds the
        measurement took (:func:`time_alone`); every state it moves put back."""
        raise NotImplementedError

    def _release(self) -> None:
        """What a pass that ran out of memory held, given back."""
        self.memory.release()

    def realign_replicas(self) -> None:
        """Rank 0's weights and optimizer state on every rank, when the ranks run on different kinds of processor.

        Every rank applies the same summed gradient, but a GPU and a CPU round the optimizer's arithmetic
        differently (fused multiply-adds, vector widths), so their weights part by about 1e-7 a step.  Once an
        epoch rank 0's copy (while devices are set aside, the rank left's: :mod:`multigpu.backend.parking`) is
        sent to all: saves, validation and the next epoch start from one model.  Ranks on one kind of processor
        compute bit-identical updates and skip this.
        """
        if len({d.kind for d in self.comm.runtime.devices}) < 2:
            return
        src = self.balancer.parking.kept if self.balancer.parking.parked else None
        with self.whole_optimizers():  # a sharded optimizer: rank 0's whole state is what is sent
            self._broadcast_variables(self._state_variables(with_optimizers=True), "realigning the replicas", src)
