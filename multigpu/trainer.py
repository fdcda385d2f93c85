"""The Keras integration: the user's model, trained data-parallel.

:func:`attach` gives one model instance its parallel behaviour by setting a
few methods on the instance (``fit``, ``evaluate``, ``predict``,
``train_step``, ``test_step``, ``get_metrics_result``, ``save``,
``save_weights``, ``summary``).  The class is untouched, so the model stays
the user's model: ``summary()``, ``layers``, ``get_weights()`` and saving see
the user's own layers, and a saved file is a plain Keras file.

Keras's own ``fit`` loop runs unchanged (callbacks, History, progress bar,
validation); it is fed a :class:`~multigpu.data.ShardedArrays` dataset that
yields this rank's share of each global batch, and the training step weights
gradients by share (:mod:`multigpu.sync`).
"""

from __future__ import annotations

import os
import random
import time
import warnings
from pathlib import Path

import keras
import numpy as np
import torch
import torch.distributed as dist
from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils

from multigpu import sync
from multigpu.balance import Rebalancer, capped_split
from multigpu.balancing import BalancingMixin
from multigpu.batchnorm import install_global_moments
from multigpu.calibrate import (
    default_profile_path,
    model_signature,
    profile_key,
)
from multigpu.data import (
    ShardedArrays,
    input_kind,
    is_array_data,
    num_rows,
    rank_rows,
    sharded_dataloader,
    sharded_generator,
    sharded_pydataset,
)
from multigpu.launch import Runtime
from multigpu.planning import num_steps
from multigpu.timing import StepTiming

__all__ = ["ParallelState", "attach"]

_OVERRIDDEN = (
    "fit",
    "evaluate",
    "predict",
    "train_step",
    "test_step",
    "get_metrics_result",
    "save",
    "save_weights",
    "summary",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)


def _batch_rows(x) -> int:
    for leaf in keras.tree.flatten(x):
        if leaf is not None:
            return int(leaf.shape[0])
    return 0


def _batchnorm_variables(model) -> list:
    out, seen = [], set()
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            for v in layer.non_trainable_variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
    return out


def _seed_variables(model) -> list:
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


class _EpochCallback(keras.callbacks.Callback):
    """Sets each epoch's row order and syncs BatchNorm statistics."""

    def __init__(self, state: ParallelState, datasets) -> None:
        super().__init__()
        self.state = state
        self.datasets = datasets

    def on_epoch_begin(self, epoch, logs=None):
        for ds in self.datasets:
            if hasattr(ds, "set_epoch"):
                ds.set_epoch(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.state.sync_batchnorm_statistics()
        self.state.epoch_report(epoch)
        if self.state.auto and self.state.rebalancer is not None and self.state.rebalancer.changes:
            specs = [d.spec for d in self.state.runtime.devices]
            key = profile_key(model_signature(self.state.model), specs)
            self.state._save_profile(self.state.profile or default_profile_path(), key, specs)


class ParallelState(BalancingMixin):
    """Everything multigpu keeps for one parallelized model.

    Args:
        model: the user's Keras model.
        runtime: this process's runtime.
    """

    def __init__(self, model, runtime: Runtime, sync_batchnorm: bool = False, *,
                 auto: bool = False, rebalance: bool = False, profile: str | None = None,
                 report: bool = False, max_batch=None) -> None:
        self.model = model
        self.runtime = runtime
        self.auto = auto
        self.rebalance = rebalance
        self.profile = profile
        self.report = report
        self.timing = StepTiming(runtime.world_size)
        self.rebalancer: Rebalancer | None = None
        self.calibrated = not auto
        self.recalibrate = False
        self.speeds: list[float] | None = None
        self.rebalance_every = 10
        self._batch_size: int | None = None
        self._steps_per_epoch: int | None = None
        self.last_report: dict | None = None
        self.sync_batchnorm = bool(sync_batchnorm) and runtime.world_size > 1
        self.caps: list[int | None] | None = list(max_batch) if max_batch is not None else None
        self.ratios = list(runtime.ratios)
        self.grad_sync: sync.WeightedGradSync | None = None
        self.train_data = None  # the ShardedArrays that fit is reading
        cls = type(model)
        self.original = {name: getattr(cls, name).__get__(model, cls) for name in _OVERRIDDEN}
        if cls.train_step is not keras.Model.train_step:
            warnings.warn(
                f"{cls.__name__} overrides `train_step`; multigpu trains with its "
                "own share-weighted step instead, so the override is not used.",
                stacklevel=3,
            )

    # ----------------------------------------------------------------- utils
    @property
    def distributed(self) -> bool:
        return self.runtime.world_size > 1

    @property
    def rank(self) -> int:
        return self.runtime.rank

    def shares_for(self, total: int) -> list[int]:
        """Rows per rank of a global batch of ``total`` rows, by the current ratios."""
        return capped_split(total, self.ratios, self.caps)

    def _shared_seed(self) -> int:
        seed = torch.tensor([random.randrange(2**31)], dtype=torch.int64)
        if self.distributed:
            dist.broadcast(seed, 0)
        return int(seed.item())

    def _verbose(self, verbose):
        return verbose if self.rank == 0 else 0

    def _ensure_grad_sync(self) -> None:
        if self.grad_sync is None and self.distributed:
            self.grad_sync = sync.WeightedGradSync(self.model, self.runtime.torch_device)
            for v in self.model.trainable_weights:
                v.value.register_post_accumulate_grad_hook(self.timing.mark_grad)
            if self.rebalance and not self.auto:
                self._start_rebalancer()
            # Dropout and other random layers must draw different numbers on
            # each rank; DDP has just made every rank's seed state equal.
            seeds = _seed_variables(self.model)
            with torch.no_grad():
                for v in seeds:
                    v.value[0] += 1_000_003 * self.rank

    def sync_batchnorm_statistics(self) -> None:
        """Averages BatchNorm moving statistics over ranks, weighted by share."""
        if not self.distributed or self.sync_batchnorm:
            return  # with global statistics every rank's are the same already
        variables = _batchnorm_variables(self.model)
        if variables:
            weight = self.ratios[self.rank] / sum(self.ratios)
            sync.average_variables(variables, weight)

    # ------------------------------------------------------------- steps
    def train_step(self, data):
        model = self.model
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        local = _batch_rows(x)
        if not self.distributed:
            return self.original["train_step"](data)
        self._ensure_grad_sync()
        sizes = self._step_sizes(local)
        if not self.calibrated:
            self._calibrate(x, y, sample_weight, local)
        timing = self.timing
        start = time.perf_counter()
        timing.grad_done = None
        total = sum(sizes)
        weight = local / total if total else 0.0
        through_ddp = all(s > 0 for s in sizes)
        # With global BatchNorm statistics the backward pass crosses ranks,
        # so each rank weights its own loss; otherwise the comm hook does.
        weight_in_loss = self.sync_batchnorm
        model.zero_grad()
        y_pred = None
        if local > 0 or weight_in_loss:
            forward = self.grad_sync.forward if through_ddp else model
            if model._call_has_training_arg:
                y_pred = forward(x, training=True)
            else:
                y_pred = forward(x)
            if local > 0:
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
                model._loss_tracker.update_state(loss, sample_weight=local)
                if weight_in_loss:
                    loss = loss * weight
            else:  # no rows here, but the statistics' collectives must run
                loss = sum(leaf.sum() for leaf in keras.tree.flatten(y_pred)) * 0.0
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
            if through_ddp:
                self.grad_sync.state.weight = 1.0 if weight_in_loss else weight
            loss.backward()
        compute_end = timing.grad_done if (local > 0 and timing.grad_done) else start
        trainable = model.trainable_weights[:]
        if through_ddp:
            gradients = [v.value.grad for v in trainable]
        else:
            gradients = sync.WeightedGradSync.manual_allreduce(trainable, 1.0 if weight_in_loss else weight)
        optimizer_start = time.perf_counter()
        with torch.no_grad():
            model.optimizer.apply(gradients, trainable)
        optimizer_seconds = time.perf_counter() - optimizer_start
        if local > 0:
            logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        else:
            logs = model.get_metrics_result()
        timing.record(start, compute_end, optimizer_seconds, time.perf_counter(), local)
        if self.rebalancer is not None and timing.window_steps >= self.rebalance_every:
            self._rebalance()
        timing.step_ended()
        return logs

    def _step_sizes(self, local: int) -> list[int]:
        """Every rank's rows in this step: from the batch plan, else asked."""
        data = self.train_data
        if data is not None and data.last_shares is not None:
            sizes = list(data.last_shares)
            if sizes[self.rank] != local:
                raise RuntimeError(
                    f"multigpu: rank {self.rank} received a batch of {local} rows but the "
                    f"plan says {sizes[self.rank]}; batches must be produced in step order."
                )
            return sizes
        return sync.exchange_sizes(local, self.runtime.world_size, self.runtime.torch_device)

    def test_step(self, data):
        model = self.model
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
        if _batch_rows(x) > 0 or not self.distributed:
            return self.original["test_step"](data)
        return model.get_metrics_result()

    def get_metrics_result(self):
        if not self.distributed:
            return self.original["get_metrics_result"]()
        # Keras's own loop, not the class method: a Keras release that
        # all-reduces metrics itself would otherwise sum them twice.
        with sync.global_metric_states(self.model):
            result = {}
            for metric in self.model.metrics:
                value = metric.result()
                result.update(value if isinstance(value, dict) else {metric.name: value})
            return {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in result.items()
            }

    # -------------------------------------------------------------- loops
    def _check_batch_size(self, batch_size, rows: int, what: str) -> int:
        if batch_size is None:
            batch_size = 32
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(
                f"`batch_size` must be a positive integer (the global batch, split "
                f"across devices). Received: batch_size={batch_size!r}"
            )
        if batch_size < self.runtime.world_size and self.rank == 0:
            warnings.warn(
                f"{what}: the global batch of {batch_size} is smaller than the "
                f"{self.runtime.world_size} devices, so some devices get no samples "
                "in each step and sit idle.",
                stacklevel=4,
            )
        return int(batch_size)

    def _rank_callbacks(self, callbacks) -> list:
        """The user's callbacks as this rank runs them.

        Writers (``CSVLogger``, ``TensorBoard``) run on rank 0 only.
        ``BackupAndRestore`` restores on every rank but saves and cleans up on
        rank 0 only; ``ModelCheckpoint`` runs everywhere and takes the same
        decision on every rank (global logs) while ``model.save`` writes once.
        """
        out = []
        for cb in list(callbacks or []):
            if self.rank != 0 and isinstance(cb, (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)):
                continue
            if self.rank != 0 and isinstance(cb, keras.callbacks.BackupAndRestore):
                object.__setattr__(cb, "_save_model", lambda: None)
                cb.delete_checkpoint = False
            out.append(cb)
        return out

    def _shard(self, x, y, sample_weight, batch_size, shuffle, seed, what: str):
        """This rank's view of ``x``: a dataset yielding its share of each batch."""
        kind = input_kind(x)
        if kind == "arrays":
            if not is_array_data(*(s for s in (y, sample_weight) if s is not None)) and (
                y is not None or sample_weight is not None
            ):
                raise TypeError(
                    f"{what}: `y` and `sample_weight` must be NumPy arrays or torch tensors when `x` is. "
                    f"Received: y of type {type(y).__name__}, sample_weight of type {type(sample_weight).__name__}"
                )
            rows = num_rows(x, y, sample_weight)
            batch_size = self._check_batch_size(batch_size, rows, what)
            self.shares_for(batch_size)  # a batch that no device cap allows fails here, on every rank
            sync.check_same_on_every_rank(rows, f"{what}: the numbers of rows", self.runtime.torch_device)
            return ShardedArrays(x, y, sample_weight, batch_size=batch_size, shares=self.shares_for,
                                 rank=self.rank, shuffle=shuffle, seed=seed)
        if kind == "other":
            raise TypeError(
                f"{what}: multigpu takes NumPy arrays or torch tensors (alone, or in lists and dicts), "
                "a keras.utils.PyDataset, a Python generator or a torch DataLoader. "
                f"Received: x of type {type(x).__name__}"
            )
        if y is not None or sample_weight is not None:
            raise ValueError(f"{what}: with a {kind}, `y` and `sample_weight` come from the data; pass None.")
        if batch_size is not None and self.rank == 0:
            warnings.warn(f"{what}: `batch_size` is ignored for a {kind}; its batches are the global batches.",
                          stacklevel=4)
        if kind == "pydataset":
            sync.check_same_on_every_rank(x.num_batches or -1, f"{what}: the numbers of batches",
                                          self.runtime.torch_device)
            return sharded_pydataset(x, shares=self.shares_for, rank=self.rank, shuffle=shuffle, seed=seed)
        if self.rank == 0:
            warnings.warn(
                f"{what}: every rank iterates its own copy of this {kind} and keeps its share of each "
                "batch. The result is exact only if every copy yields the same batches in the same "
                "order (seed any shuffling, e.g. keras.utils.set_random_seed before building it).",
                stacklevel=4,
            )
        if kind == "dataloader":
            return sharded_dataloader(x, self.shares_for, self.rank)
        return sharded_generator(x, self.shares_for, self.rank)

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
    ):
        """Keras ``fit`` with ``batch_size`` as the global batch, split by share."""
        if not self.distributed:
            return self.original["fit"](
                x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                callbacks=callbacks, validation_split=validation_split,
                validation_data=validation_data, shuffle=shuffle,
                class_weight=class_weight, sample_weight=sample_weight,
                initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
                validation_steps=validation_steps,
                validation_batch_size=validation_batch_size,
                validation_freq=validation_freq,
            )
        seed = self._shared_seed()
        if input_kind(x) == "arrays":
            num_rows(x, y, sample_weight)  # inputs and targets of one length, checked on every rank
            if validation_split and validation_data is None:
                (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
                    (x, y, sample_weight), validation_split=validation_split
                )
        elif validation_split:
            raise ValueError(
                "`validation_split` needs arrays (as in Keras); pass `validation_data` for "
                f"datasets. Received: x of type {type(x).__name__}"
            )
        train = self._shard(x, y, sample_weight, batch_size, shuffle, seed, "fit")
        datasets = [train]
        val = None
        if validation_data is not None:
            if input_kind(validation_data) in ("arrays", "other") and isinstance(validation_data, (tuple, list)):
                vx, vy, vsw = data_adapter_utils.unpack_x_y_sample_weight(validation_data)
            else:
                vx, vy, vsw = validation_data, None, None
            val = self._shard(vx, vy, vsw, validation_batch_size or batch_size, False, seed, "validation")
        callbacks = [_EpochCallback(self, datasets), *self._rank_callbacks(callbacks)]
        self.train_data = train if hasattr(train, "last_shares") else None
        self._batch_size = getattr(train, "batch_size", None) or batch_size
        self._steps_per_epoch = steps_per_epoch or getattr(train, "num_batches", None)
        self.timing.reset_epoch()
        self.timing.last_end = None
        try:
            return self.original["fit"](
                train, epochs=epochs, verbose=self._verbose(verbose), callbacks=callbacks,
                validation_data=val, shuffle=False, class_weight=class_weight,
                initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
                validation_steps=validation_steps, validation_freq=validation_freq,
            )
        finally:
            self.train_data = None

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, **kwargs):
        """Keras ``evaluate`` on this rank's share; returns global results."""
        if not self.distributed:
            return self.original["evaluate"](
                x, y, batch_size=batch_size, verbose=verbose, sample_weight=sample_weight,
                steps=steps, callbacks=callbacks, return_dict=return_dict, **kwargs,
            )
        self.sync_batchnorm_statistics()
        if kwargs.get("_use_cached_eval_dataset"):
            return self.original["evaluate"](
                x, y, batch_size=batch_size, verbose=self._verbose(verbose),
                sample_weight=sample_weight, steps=steps, callbacks=callbacks,
                return_dict=return_dict, **kwargs,
            )
        data = self._shard(x, y, sample_weight, batch_size, False, 0, "evaluate")
        return self.original["evaluate"](
            data, verbose=self._verbose(verbose), steps=steps, callbacks=callbacks,
            return_dict=return_dict, **kwargs,
        )

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Keras ``predict`` on this rank's share; every rank gets all rows."""
        if not self.distributed:
            return self.original["predict"](x, batch_size=batch_size, verbose=verbose,
                                            steps=steps, callbacks=callbacks)
        self.sync_batchnorm_statistics()
        if not is_array_data(x):
            # Datasets and generators: every rank predicts everything itself
            # (exact, no speed-up), so that every rank returns all rows.
            return self.original["predict"](x, batch_size=batch_size, verbose=self._verbose(verbose),
                                            steps=steps, callbacks=callbacks)
        rows = num_rows(x)
        batch_size = self._check_batch_size(batch_size, rows, "predict")
        pieces = [rank_rows(s * batch_size, min((s + 1) * batch_size, rows), self.shares_for, self.rank)
                  for s in range(num_steps(rows, batch_size))]
        index = np.concatenate([np.arange(b, e) for b, e in pieces]) if pieces else np.arange(0)
        local_x = keras.tree.map_structure(
            lambda a: a[index] if isinstance(a, np.ndarray) else a[torch.as_tensor(index)], x
        )
        local_batch = max(1, max((e - b for b, e in pieces), default=1))
        if len(index):
            out = self.original["predict"](local_x, batch_size=local_batch,
                                           verbose=self._verbose(verbose), callbacks=callbacks)
        else:
            out = None
        gathered = [None] * self.runtime.world_size
        dist.all_gather_object(gathered, (index, out))
        template = next(o for _, o in gathered if o is not None)
        order = np.concatenate([i for i, _ in gathered])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))

        def merge(*parts):
            return np.concatenate([p for p in parts])[inverse]

        outs = [o for _, o in gathered if o is not None]
        return keras.tree.map_structure(merge, *outs) if len(outs) > 1 else keras.tree.map_structure(
            lambda a: a[inverse], template
        )

    def train_on_batch(self, *args, **kwargs):
        if self.distributed:
            raise NotImplementedError(
                "train_on_batch is not supported on a model parallelized over "
                f"{self.runtime.world_size} devices; use fit(x, y, batch_size=...), "
                "which splits each batch across the devices."
            )
        return self.original["train_on_batch"](*args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        if self.distributed:
            raise NotImplementedError(
                "test_on_batch is not supported on a parallelized model; use "
                "evaluate(x, y, batch_size=len(x)), which returns the same global result."
            )
        return self.original["test_on_batch"](*args, **kwargs)

    def predict_on_batch(self, x):
        # Stateless: every rank computes the whole batch itself.
        return self.original["predict_on_batch"](x)

    # ----------------------------------------------------------- saving
    def _atomic(self, method: str, filepath, *args, **kwargs):
        if self.rank != 0:
            return None
        path = Path(os.fspath(filepath))
        suffix = "".join(path.suffixes[-2:]) if path.name.endswith(".weights.h5") else path.suffix
        tmp = path.with_name(f".{path.name[: -len(suffix) or None]}.tmp{os.getpid()}{suffix}")
        try:
            result = self.original[method](tmp, *args, **kwargs)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return result

    def save(self, filepath, overwrite=True, **kwargs):
        """Writes a plain Keras file, once (rank 0), atomically."""
        if not overwrite and Path(os.fspath(filepath)).exists():
            return self.original["save"](filepath, overwrite=False, **kwargs)
        return self._atomic("save", filepath, overwrite=True, **kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Writes the weights, once (rank 0), atomically."""
        if not overwrite and Path(os.fspath(filepath)).exists():
            return self.original["save_weights"](filepath, overwrite=False, **kwargs)
        return self._atomic("save_weights", filepath, overwrite=True, **kwargs)

    def summary(self, *args, **kwargs):
        """The model's own summary (rank 0 only) plus one line on the devices."""
        if self.rank != 0:
            return None
        result = self.original["summary"](*args, **kwargs)
        print_fn = kwargs.get("print_fn") or print
        print_fn(self.runtime.describe())
        return result


def attach(model, runtime: Runtime, sync_batchnorm: bool = False, *, recalibrate: bool = False,
           **options) -> ParallelState:
    """Makes ``model`` train across the run's devices (see module docstring)."""
    if getattr(model, "_multigpu_state", None) is not None:
        raise ValueError(
            "multigpu.parallelize() was already called on this model. Call it "
            "once per model; the returned model is the same object."
        )
    state = ParallelState(model, runtime, sync_batchnorm, **options)
    state.recalibrate = recalibrate
    if state.sync_batchnorm:
        install_global_moments(model)
    object.__setattr__(model, "_multigpu_state", state)
    for name in _OVERRIDDEN:
        object.__setattr__(model, name, getattr(state, name))
    return state
