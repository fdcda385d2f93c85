"""The training, test and predict steps of a parallel model on torch.

One global batch, followed from the data to the weights:

1. the data path cut this rank's rows and queued the batch's plan
   (:mod:`multigpu.keras.data`); the step takes the plan back;
2. the step sets the gradient weight ``b_r / B`` from the plan;
3. forward, loss, metrics, backward, as Keras's own step (the forward pass
   and loss replayed as recorded torch operations where that gives the same
   result: :mod:`multigpu.backend.torch.replay`);
4. the step sums the weighted gradients over ranks in one collective, which
   also carries the metric states and the step timings
   (:meth:`GradientSync.sum <multigpu.backend.torch.reducer.GradientSync.sum>`),
   then calls Keras's own ``apply`` of the optimizer's class with the sums
   (the update runs block by block: :mod:`multigpu.backend.torch.optimizers`);
5. the logs come back global, and the balancer reads every rank's timings.

A model class that overrides ``train_step`` (or ``test_step``,
``predict_step``) keeps its own step (:mod:`.custom`).  The step's life
around one attempt (the plan, calibration, taking it again after a lost
rank or an out-of-memory error, its message) is the driver's
(:mod:`multigpu.backend.driver`); test and predict steps and the global
logs: :mod:`.evaluation`.
"""

from __future__ import annotations

import contextlib
import warnings

import keras
import torch

from multigpu import membership
from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import optimizers_of, own_method
from multigpu.backend.driver import StepDriver
from multigpu.backend.recovery import Recovery
from multigpu.backend.sharding import whole_size
from multigpu.backend.steps import StepsCore, time_alone
from multigpu.backend.torch import optimizers as blockwise
from multigpu.backend.torch.batchnorm import install_global_moments
from multigpu.backend.torch.custom import OwnTrainStep
from multigpu.backend.torch.evaluation import Evaluation
from multigpu.backend.torch.memory import CudaMemory
from multigpu.backend.torch.metrics import ALL_METRICS, GlobalMetrics
from multigpu.backend.torch.reducer import GradientSync
from multigpu.backend.torch.replay import ForwardReplay
from multigpu.backend.torch.sharding import ShardedOptimizers
from multigpu.backend.torch.weights import WeightsInParts
from multigpu.balancing.caps import DeviceMemory
from multigpu.planning.partition import owners

__all__ = ["TorchSteps"]


class TorchSteps(Evaluation, StepsCore):
    """The steps of one parallel model (see the module docstring and :mod:`multigpu.backend.steps`).

    Args:
        parallel: the model's :class:`~multigpu.keras.parallel.ParallelModel`.
    """

    def __init__(self, parallel) -> None:
        super().__init__(parallel)
        model = self.model
        self.sync = GradientSync(self.comm, self.timing.waiting, parallel.options.compression,
                                 overlap=_overlap(self.comm, parallel.options.overlap),
                                 bucket_bytes=_bucket_bytes(parallel.options.bucket_mb),
                                 stream_model=(model if parallel.options.shard_gradients
                                               and self.user_train_step is None else None))
        self.metrics = GlobalMetrics(model, self.comm)
        self.memory = DeviceMemory(self.comm, self.balancer,
                                   CudaMemory(self.comm.device) if self.comm.device.type == "cuda" else None)
        self.sync_batchnorm = parallel.options.sync_batchnorm
        # Global BatchNorm statistics run collectives inside the forward pass: Keras's own pass then.
        # A device of bounded memory keeps the recorded passes of two local batch sizes, not eight: each holds
        # memory the rows need (a CPU device given 44 MiB had 8 MiB of them, 80 rows of its batch).
        self.weights = (WeightsInParts(self.comm, parallel.ledger, model)
                        if parallel.options.shard_weights else None)  # (gathered by each layer's call: not replayed)
        self.forward = ForwardReplay(model, enabled=not self.sync_batchnorm and self.weights is None,
                                     replay=parallel.options.replay is not False,
                                     max_graphs=2 if self.memory.measured_here else 8)
        cls = type(model)
        self.keras_compute_metrics = (own_method(cls, "compute_metrics") is None
                                      and own_method(cls, "get_metrics_result") is None)
        self.own_step = OwnTrainStep(self)
        self._recorded = False
        self._seen: dict[int, object] = {}  # the optimizers whose apply is wrapped, by id
        self._kept_overlap = None  # the sums during the backward pass, while devices are set aside
        self.shards = ShardedOptimizers(self.comm, parallel.ledger) if parallel.options.shard_optimizer else None
        self.recovery = Recovery(self)
        self.driver = StepDriver(self)
        if self.sync_batchnorm:
            install_global_moments(model, parallel.ledger)

    @property
    def overlapping(self) -> bool:
        return self.sync.overlapping

    def sum_over_all(self, every: bool) -> None:
        """Sums during the backward pass go to the whole group: none while devices are set aside."""
        self.sync.overlap, self._kept_overlap = (self._kept_overlap, None) if every else (False, self.sync.overlap)

    def methods(self) -> dict:
        """What the model instance gets.

        ``_initialize_ddp`` does nothing: from Keras 3.16 the torch trainer wraps a model in DDP once a process
        group is up, and multigpu's steps sum the gradients (weighted by the shares) and the metrics themselves.
        """
        return {"train_step": self.train_step, "test_step": self.test_step, "predict_step": self.predict_step,
                "get_metrics_result": self.get_metrics_result, "reset_metrics": self.reset_metrics,
                "_initialize_ddp": _no_ddp}

    # ---------------------------------------------------------- variables
    def _broadcast_variables(self, variables, what: str, src: int | None = None) -> None:
        _move_to(self.model.variables, self.comm.device)
        self.comm.broadcast([v.value for v in variables], src=src, what=what)

    # ---------------------------------------------------------- training
    def train_step(self, data):
        self._initialize()
        return self.driver.train(data, self._train_on)

    # ---------------------------------------------------------- recovery's and the driver's hooks
    def snapshot(self) -> list:
        """The states a step changes before its sum: metric states (kept by ``metrics``), non-trainables."""
        self.metrics.keep()
        return [v.value.detach().clone() for v in self.model.non_trainable_variables]

    def restore_forward(self, kept: list | None) -> None:
        with torch.no_grad():
            for v, value in zip(self.model.non_trainable_variables, kept or ()):
                v.value.copy_(value)

    def undo_updates(self) -> None:
        self.sync.undo()  # a step of the model's own: what its updates changed before its logs' sum failed

    def finish_sum(self, summed: list[float], n_timing: int, adopt: dict):
        return self._finish(summed, "train", n_timing, adopt=adopt)

    def _train_on(self, data, plan):
        membership.at("forward", self.comm.rank)
        self.metrics.invalidate()
        self.timing.begin()
        self._see_optimizers()
        # With global BatchNorm statistics the backward pass crosses ranks, so each rank weights its own loss.
        # A step of the model's own sums its logs after its updates: in a run that may lose a rank it keeps what
        # they change, to take the step again after a loss in that sum.
        if self.weights is not None:
            self.weights.begin_step()
        self.sync.begin_step(1.0 if self.sync_batchnorm else plan.weight,
                             keep=self.comm.min_devices is not None and self.user_train_step is not None)
        try:
            if self.user_train_step is not None:
                logs = self.own_step.train(data, plan)
            else:
                logs = self._builtin_train(data, plan)
        finally:
            self.sync.end_step()
            if self.weights is not None:
                self.weights.release_all()
        if self.weights is not None:
            self.weights.end_step()
        self.sync.forget_kept()  # the step is done everywhere: no putting back its updates
        self.driver.done(plan, measured=not self._recorded)  # a step that recorded its forward pass: not timed
        self._recorded = False
        return logs

    def _builtin_train(self, data, plan):
        model = self.model
        model.zero_grad()
        trainable = model.trainable_weights[:]
        logs_local, short, cap = None, 0, 0
        parted = self.weights is not None and self.weights.active
        if plan.local > 0 or self.sync_batchnorm or parted:  # (global statistics, weights in parts: a rank with no
            # rows joins their collectives; with weights in parts a step that ran out of memory cannot be taken again)
            logs_local, short, cap = self.driver.local(
                plan.local, lambda: self._forward_backward(data, plan, trainable), self._release,
                may_retry=not parted)
        extras = self.metrics.pack(logs_local, plan.local - short, self.driver.say(short, cap), "train")
        if not trainable:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        grads, summed = self.sync.sum([v.value.grad for v in trainable], trainable, extras)
        self.driver.heard(summed[-self.driver.message.size:])  # new caps; a rank that ran out: none applies it
        if trainable:
            membership.at("update", self.comm.rank)
            with torch.no_grad():
                type(model.optimizer).apply(model.optimizer, grads, trainable)  # Keras's own apply
        return self._finish(summed, "train")

    def _forward_backward(self, data, plan, trainable):
        """This rank's forward and backward passes of a training step; returns its local logs."""
        model = self.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        logs_local = None
        if plan.local > 0:
            y_pred, loss, self._recorded = self.forward(x, y, sample_weight, prompt=self.balancer.searching,
                                                        ahead=self.steps_ahead(plan))
            tracker = _compat.loss_tracker(model)
            if tracker is not None:
                tracker.update_state(loss, sample_weight=plan.local)
            if self.keras_compute_metrics:  # the logs are exactly model.metrics: update them only
                with self.metrics.no_results():
                    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
                logs_local = ALL_METRICS
            else:
                with self.metrics.local_results():
                    logs_local = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        else:  # no rows here, but the global statistics' collectives must run
            y_pred = model(x, training=True) if _compat.call_has_training_arg(model) else model(x)
            loss = sum(leaf.sum() for leaf in keras.tree.flatten(y_pred)) * 0.0
        if self.sync_batchnorm:
            loss = loss * plan.weight
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
        if trainable:
            loss.backward()
        return logs_local

    def _release(self) -> None:
        """What a pass that ran out of memory held, given back: the gradients, the recorded passes."""
        self.model.zero_grad()
        self.forward.forget()
        self.memory.release()

    def prepare_optimizers(self) -> None:
        optimizer = self.model.optimizer
        if self.shards is not None and optimizer is not None:
            self._see_optimizers()
        if self.weights is not None and optimizer is not None and not self.weights.active:
            if getattr(optimizer, "use_ema", False):
                raise ValueError("shard='weights' cannot take an optimizer with `use_ema=True`: its averages are "
                                 "updated from every weight, which each device holds only in part. Received: "
                                 f"{type(optimizer).__name__}(use_ema=True). Use shard='gradients'.")
            self._initialize()  # rank 0's weights everywhere before each rank lets go of the others' parts,
            # then the optimizer state of its own part is built (the partition is the optimizer's)
            variables = list(self.model.trainable_variables)
            self.weights.begin(variables, owners([whole_size(v) for v in variables], self.shards.weights))
            self.shards.parted = {id(v) for g in self.weights.groups for v in g.variables}
        super().prepare_optimizers()

    def fit_ends(self) -> None:
        """Weights in parts: the most each device held at once, said (they stay in parts after ``fit``)."""
        if self.weights is None or not self.weights.active:
            return
        reports = self.comm.gather_objects(self.weights.report(), "gathering the weights' figures")
        self.balancer.log("the weights in parts: " + "; ".join(
            f"{d.label} owned {_mib(r['owned'])} of {_mib(r['total'])} and held at most "
            f"{_mib(r['peak'])} of the others' at once"
            for d, r in zip(self.comm.runtime.devices, reports) if r is not None))

    @contextlib.contextmanager
    def whole_optimizers(self):
        """The optimizers' whole state and every weight on every rank for the block (a collective)."""
        with contextlib.ExitStack() as stack:
            if self.weights is not None:
                stack.enter_context(self.weights.whole())
            stack.enter_context(super().whole_optimizers())
            yield

    def whole_weights(self):
        return self.weights.whole() if self.weights is not None else contextlib.nullcontext()

    def gather_optimizers(self) -> None:
        if self.weights is not None:
            self.weights.end()
        super().gather_optimizers()

    def _see_optimizers(self) -> None:
        """Each optimizer, the first time it is seen: its ``apply`` sums for a step of the model's own (the
        built-in step sums itself), and its update runs block by block."""
        for optimizer in optimizers_of(self.model):
            if id(optimizer) not in self._seen:
                self._seen[id(optimizer)] = optimizer
                self.sync.wrap(optimizer, self.parallel.ledger)
                blockwise.install(optimizer, self.parallel.ledger)
                if self.shards is not None:
                    self.shards.see(optimizer)

    def _solo_rate(self, data, rows: int) -> tuple[float, float]:
        """Samples/s of forward and backward passes on this rank's batch, alone; every variable restored."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        whole = self.weights.whole() if self.weights is not None else contextlib.nullcontext()
        with whole:  # (weights in parts: each rank's passes alone, on every weight)
            return self._solo_rate_whole(x, y, sample_weight, rows)

    def _solo_rate_whole(self, x, y, sample_weight, rows: int) -> tuple[float, float]:
        model = self.model
        variables = list(model.variables)
        saved = [v.value.detach().clone() for v in variables]

        def one_pass() -> bool:
            model.zero_grad()
            _, loss, recorded = self.forward(x, y, sample_weight)
            loss.backward()
            return not recorded  # a pass recorded for replay is not what the steps will run

        try:
            return time_alone(one_pass, rows, warmup=1)
        finally:
            with torch.no_grad():
                for v, s in zip(variables, saved):
                    v.value.copy_(s)
            model.zero_grad()


def _move_to(variables, device: torch.device) -> None:
    """Puts variables built before this rank chose its GPU (under torchrun, every rank's on cuda:0) on it."""
    if device.type != "cuda":
        return
    with torch.no_grad():
        for v in variables:
            value = v.value
            if value.device != device:
                value.data = value.data.to(device)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.3g} MiB"


def _bucket_bytes(mb: float | None) -> int | None:
    return None if mb is None else int(mb * (1 << 20))


def _overlap(comm, forced: bool | None = None) -> bool:
    """Whether gradient sums start during the backward pass (``forced``, from ``parallelize(overlap=)``, decides
    instead when it is set).

    Between machines, and for GPUs, whose collectives run beside their
    computing.  Not for CPU ranks of one machine: there gloo's threads take
    the cycles of the cores that compute the backward pass, so overlap costs
    more than it hides (dense41m at batch 256 over gloo on two cores: 390
    samples/s with it, 475 without, 555 over shared memory;
    benchmarks/network/README.md).
    """
    if forced is not None:
        return forced and comm.world_size > 1
    runtime = comm.runtime
    one_machine_cpus = runtime.same_host and not any(d.is_cuda for d in runtime.devices)
    return comm.world_size > 1 and comm.transport != "shm" and not one_machine_cpus


def _no_ddp() -> None:
    """Keras 3.16's ``_initialize_ddp`` on a parallel model: multigpu sums the gradients, not DDP."""
