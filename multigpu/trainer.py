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
import warnings
from pathlib import Path

import keras
import numpy as np
import torch
import torch.distributed as dist
from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils

from multigpu import sync
from multigpu.data import ShardedArrays, is_array_data, num_rows, rank_rows
from multigpu.launch import Runtime
from multigpu.planning import num_steps

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
            ds.set_epoch(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.state.sync_batchnorm_statistics()


class ParallelState:
    """Everything multigpu keeps for one parallelized model.

    Args:
        model: the user's Keras model.
        runtime: this process's runtime.
    """

    def __init__(self, model, runtime: Runtime) -> None:
        self.model = model
        self.runtime = runtime
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

    def current_ratios(self) -> list[float]:
        return self.ratios

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
            # Dropout and other random layers must draw different numbers on
            # each rank; DDP has just made every rank's seed state equal.
            seeds = _seed_variables(self.model)
            with torch.no_grad():
                for v in seeds:
                    v.value[0] += 1_000_003 * self.rank

    def sync_batchnorm_statistics(self) -> None:
        """Averages BatchNorm moving statistics over ranks, weighted by share."""
        if not self.distributed:
            return
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
        total = sum(sizes)
        weight = local / total if total else 0.0
        through_ddp = all(s > 0 for s in sizes)
        model.zero_grad()
        y_pred = None
        if local > 0:
            forward = self.grad_sync.forward if through_ddp else model
            if model._call_has_training_arg:
                y_pred = forward(x, training=True)
            else:
                y_pred = forward(x)
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            model._loss_tracker.update_state(loss, sample_weight=local)
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
            if through_ddp:
                self.grad_sync.state.weight = weight
            loss.backward()
        trainable = model.trainable_weights[:]
        if through_ddp:
            gradients = [v.value.grad for v in trainable]
        else:
            gradients = sync.WeightedGradSync.manual_allreduce(trainable, weight)
        with torch.no_grad():
            model.optimizer.apply(gradients, trainable)
        if local > 0:
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return model.get_metrics_result()

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
        if not is_array_data(x, y, sample_weight):
            raise TypeError(
                "multigpu's fit takes NumPy arrays or torch tensors (alone, or in "
                "lists and dicts) for `x`, `y` and `sample_weight`, so that it can "
                f"cut every global batch by share. Received: x of type {type(x).__name__}"
            )
        rows = num_rows(x, y, sample_weight)
        batch_size = self._check_batch_size(batch_size, rows, "fit")
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
                (x, y, sample_weight), validation_split=validation_split
            )
        seed = self._shared_seed()
        train = ShardedArrays(
            x, y, sample_weight, batch_size=batch_size, ratios=self.current_ratios,
            rank=self.rank, shuffle=shuffle, seed=seed,
        )
        datasets = [train]
        val = None
        if validation_data is not None:
            vx, vy, vsw = data_adapter_utils.unpack_x_y_sample_weight(validation_data)
            val = ShardedArrays(
                vx, vy, vsw, batch_size=validation_batch_size or batch_size,
                ratios=self.current_ratios, rank=self.rank, shuffle=False,
            )
        callbacks = [_EpochCallback(self, datasets), *(callbacks or [])]
        self.train_data = train
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
        if not is_array_data(x, y, sample_weight):
            raise TypeError(
                "multigpu's evaluate takes NumPy arrays or torch tensors. "
                f"Received: x of type {type(x).__name__}"
            )
        rows = num_rows(x, y, sample_weight)
        batch_size = self._check_batch_size(batch_size, rows, "evaluate")
        data = ShardedArrays(x, y, sample_weight, batch_size=batch_size,
                             ratios=self.current_ratios, rank=self.rank)
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
            raise TypeError(
                "multigpu's predict takes NumPy arrays or torch tensors. "
                f"Received: x of type {type(x).__name__}"
            )
        rows = num_rows(x)
        batch_size = self._check_batch_size(batch_size, rows, "predict")
        ratios = list(self.ratios)
        pieces = [rank_rows(s * batch_size, min((s + 1) * batch_size, rows), ratios, self.rank)
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


def attach(model, runtime: Runtime) -> ParallelState:
    """Makes ``model`` train across the run's devices (see module docstring)."""
    if getattr(model, "_multigpu_state", None) is not None:
        raise ValueError(
            "multigpu.parallelize() was already called on this model. Call it "
            "once per model; the returned model is the same object."
        )
    state = ParallelState(model, runtime)
    object.__setattr__(model, "_multigpu_state", state)
    for name in _OVERRIDDEN:
        object.__setattr__(model, name, getattr(state, name))
    return state
