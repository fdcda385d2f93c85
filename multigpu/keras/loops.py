"""``fit``, ``evaluate``, ``predict`` and the ``*_on_batch`` methods of a parallel model.

Each one cuts the user's data into this rank's shares (:mod:`multigpu.keras.data`)
and hands them to Keras's own method (after the model class's own method,
when it has one: :mod:`multigpu.keras.own_loops`), so Keras's loop, callbacks, History and
progress bar run unchanged, once per global batch on every rank.  ``batch_size``
is the global batch.  ``predict`` and ``predict_on_batch`` gather every rank's
rows afterwards, so every rank returns all rows in their original order.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np

from multigpu.data.forms import as_arrays, input_kind, num_rows, validation_split
from multigpu.data.host import Host
from multigpu.data.sources import source_for
from multigpu.keras.callbacks import EpochHooks, for_rank
from multigpu.keras.data import ShardedData
from multigpu.keras.own_loops import own_methods
from multigpu.log import logger as log

__all__ = ["Loops"]


def _check_batch_size(batch_size, world_size: int, rank: int, what: str) -> int:
    if batch_size is None:
        batch_size = 32
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"{what}: `batch_size` must be a positive integer (the global batch, split across "
                         f"devices). Received: batch_size={batch_size!r}")
    if batch_size < world_size and rank == 0:
        from multigpu._warn import warn_user

        warn_user(f"{what}: the global batch of {batch_size} is smaller than the {world_size} devices, so some "
                  "devices get no samples in each step and sit idle.")
    return int(batch_size)


def _with_class_weight(y, sample_weight, class_weight, what: str):
    if class_weight is None:
        return sample_weight
    if sample_weight is not None:
        raise ValueError(f"{what}: `sample_weight` and `class_weight` cannot both be given. Received: "
                         f"sample_weight of type {type(sample_weight).__name__}, class_weight={class_weight!r}")
    if y is None:
        raise ValueError(f"{what}: `class_weight` needs targets `y`. Received: y=None")
    return _class_weight_to_sample_weights(y, class_weight)


def _class_weight_to_sample_weights(y, class_weight: dict):
    """Per-row weights from ``class_weight``, as Keras computes them (sparse or one-hot ``y``)."""
    import numpy as np

    y_numpy = keras.ops.convert_to_numpy(y)
    weights = np.ones((y_numpy.shape[0],), dtype=keras.backend.floatx())
    if y_numpy.ndim > 1:
        y_numpy = np.argmax(y_numpy, axis=-1) if y_numpy.shape[-1] != 1 else np.squeeze(y_numpy, axis=-1)
    labels = np.round(y_numpy).astype("int64")
    for i, label in enumerate(labels):
        weights[i] = class_weight.get(int(label), 1.0)
    return weights


class Loops:
    """The loops of one parallel model.

    Args:
        parallel: the model's :class:`~multigpu.keras.parallel.ParallelModel`.
    """

    def __init__(self, parallel) -> None:
        self.parallel = parallel
        self.rank = parallel.runtime.rank
        self.world_size = parallel.runtime.world_size
        self.keras = parallel.keras
        self.own = own_methods(parallel.model)

    def methods(self) -> dict:
        """What the model instance gets: multigpu's loops, except those its class defines (:meth:`handed_over`)."""
        return {name: method for name, method in self._ours().items() if name not in self.own}

    def handed_over(self) -> dict:
        """multigpu's loops that the ``super()`` calls of the class's own methods reach
        (:func:`~multigpu.keras.own_loops.hand_over`)."""
        return {name: method for name, method in self._ours().items() if name in self.own}

    def _ours(self) -> dict:
        return {"fit": self.fit, "evaluate": self.evaluate, "predict": self.predict,
                "train_on_batch": self.train_on_batch, "test_on_batch": self.test_on_batch,
                "predict_on_batch": self.predict_on_batch}

    @property
    def _writer(self) -> int:
        """0 on the rank that prints and writes (rank 0, or the lowest one left after it was lost), else 1."""
        return 0 if self.rank == self.parallel.comm.leader else 1

    def _callbacks(self, callbacks) -> list:
        return for_rank(callbacks, self._writer, self.parallel.ledger)

    def _verbose(self, verbose):
        return verbose if self._writer == 0 else 0

    def _data(self, x, y, sample_weight, batch_size, shuffle, seed, what: str, training: bool,
              checked: bool = True) -> ShardedData:
        """``checked=False`` on a rank that came back: the others checked the data when the call began."""
        p = self.parallel
        x, y, sample_weight = as_arrays(x, y, sample_weight)
        kind = input_kind(x)
        if kind == "arrays":
            batch_size = _check_batch_size(batch_size, self.world_size, self.rank, what)
            rows = num_rows(x, y, sample_weight)
            if training:
                p.balancer.shares(batch_size)  # a batch that no device cap allows fails here, on every rank
            if checked:
                p.comm.check_same(rows, f"{what}: the numbers of rows")
        elif seed is None:
            seed = p.comm.shared_seed()  # names this call's input files apart from any other's
        host = Host.of(p.runtime, p.comm, seed or 0)
        source = source_for(x, y, sample_weight, batch_size, shuffle, seed or 0, what, host)
        if kind in ("pydataset", "dataloader", "tf.data") and checked:
            p.comm.check_same(source.num_batches or -1, f"{what}: the numbers of batches")
        return ShardedData(source, p.balancer.planner, training=training,
                           input_time=p.timing.note_input if training else None)

    # ------------------------------------------------------------------ fit
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
            validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_batch_size=None, validation_freq=1):
        """Keras ``fit``; ``batch_size`` is the global batch, split by the current shares.

        On a lost rank started again (``--max-restarts``), ``fit`` first waits
        until the others take it in, then starts at their epoch and step.
        """
        p = self.parallel
        x, y, sample_weight = as_arrays(x, y, sample_weight)
        rejoinable = input_kind(x) == "arrays" and steps_per_epoch is None
        back = self._come_back(x, rejoinable)
        seed = back["seed"] if back else p.comm.shared_seed()
        p.position.update(seed=seed, rejoinable=rejoinable, epochs=epochs)
        if input_kind(x) == "arrays":
            num_rows(x, y, sample_weight)  # inputs and targets of one length, checked on every rank
            sample_weight = _with_class_weight(y, sample_weight, class_weight, "fit")
            class_weight = None
            if validation_split and validation_data is None:
                (x, y, sample_weight), validation_data = _split(x, y, sample_weight, validation_split)
        elif validation_split:
            raise ValueError("`validation_split` needs arrays (as in Keras); pass `validation_data` for datasets. "
                             f"Received: x of type {type(x).__name__}")
        elif class_weight is not None:
            raise ValueError("multigpu: `class_weight` needs arrays; for datasets, yield sample weights instead. "
                             f"Received: x of type {type(x).__name__}")
        train = self._data(x, y, sample_weight, batch_size, shuffle, seed, "fit", training=True,
                           checked=back is None)
        val = None
        if validation_data is not None:
            if isinstance(validation_data, (tuple, list)):
                vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
            else:
                vx, vy, vsw = validation_data, None, None
            val = self._data(vx, vy, vsw, validation_batch_size or batch_size, False, seed, "validation",
                             training=False, checked=back is None)
        p.balancer.begin_fit(train.batch_size, p.signature, steps_per_epoch or train.num_batches)
        if back:
            p.balancer.rejoined(back["ratios"], back["out"])
            train.resume_at(back["epoch"], back["step"])
            initial_epoch = back["epoch"]
        p.steps_per_epoch = steps_per_epoch or train.num_batches
        p.steps.settle_parts()
        p.steps.check_state(skip=back is not None)
        p.steps.prepare_optimizers()
        p.timing.break_continuity()
        try:
            with warnings.catch_warnings():
                if back:  # Keras's word for a first epoch that starts at the others' step
                    warnings.filterwarnings("ignore", message="Your input ran out of data")
                history = self.keras["fit"](
                    train, epochs=epochs, verbose=self._verbose(verbose),
                    callbacks=[EpochHooks(p, train), *self._callbacks(callbacks)], validation_data=val,
                    shuffle=False, initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
                    validation_steps=validation_steps, validation_freq=validation_freq,
                )
        finally:
            for data in (train, val):
                if data is not None:
                    data.close()
        self._ended("fit")
        return history

    def _come_back(self, x, rejoinable: bool) -> dict | None:
        """On a lost rank started again: waits until the others take it in, and returns what they sent (the
        position of their ``fit``: ``seed``, ``epoch``, ``step``; the shares ``ratios``; the ranks still ``out``)."""
        comm = self.parallel.comm
        if not comm.joining:
            return None
        if not rejoinable:  # the others go on without it
            log.error(f"rank {self.rank} cannot rejoin this fit(): a lost rank comes back in a fit() on "
                      "arrays or tensors held in memory over whole epochs (no steps_per_epoch), whose batches it can "
                      f"start at the others' step; this one reads x of type {type(x).__name__}. It leaves the run.")
            raise SystemExit(0)
        return comm.rejoin()

    def _ended(self, what: str) -> None:
        """Returns once every rank has run its callbacks' end hooks: what rank 0's callbacks wrote at the end
        (a CSV log closed, a backup deleted, a last checkpoint) is there when any rank goes on."""
        self.parallel.comm.sum_floats([0.0], f"waiting for every rank to end {what}")

    # ------------------------------------------------------------- evaluate
    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
                 callbacks=None, return_dict=False, **kwargs):
        """Keras ``evaluate`` on this rank's shares; returns the global loss and metrics on every rank."""
        p = self.parallel
        p.steps.sync_batchnorm_statistics()
        if kwargs.get("_use_cached_eval_dataset"):  # validation inside fit: x is already cut
            return self.keras["evaluate"](x, y, batch_size=batch_size, verbose=self._verbose(verbose),
                                          sample_weight=sample_weight, steps=steps, callbacks=callbacks,
                                          return_dict=return_dict, **kwargs)
        data = self._data(x, y, sample_weight, batch_size, False, None, "evaluate", training=False)
        try:
            result = self.keras["evaluate"](data, verbose=self._verbose(verbose), steps=steps,
                                            callbacks=self._callbacks(callbacks), return_dict=return_dict,
                                            **kwargs)
        finally:
            data.close()
        self._ended("evaluate")
        return result

    # -------------------------------------------------------------- predict
    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Keras ``predict`` on this rank's shares; every rank returns all rows in their order."""
        p = self.parallel
        p.steps.sync_batchnorm_statistics()
        data = self._data(x, None, None, batch_size, False, None, "predict", training=False)
        try:
            out = self.keras["predict"](data, verbose=self._verbose(verbose), steps=steps,
                                        callbacks=self._callbacks(callbacks))
        finally:
            data.close()
        return self._gather([plan.sizes for plan in data.plans], out)

    def _gather(self, sizes: list[tuple[int, ...]], out):
        """Every rank's rows, in their global order (step by step, rank by rank)."""
        parts = self.parallel.comm.gather_objects(out, "gathering predictions")
        present = [r for r in range(self.world_size) if parts[r] is not None]
        missing = [r for r in range(self.world_size) if parts[r] is None and any(s[r] for s in sizes)]
        if missing:
            raise RuntimeError(f"multigpu: rank(s) {missing} were lost during predict() with rows of it; call "
                               "predict() again (the ranks left take every row).")
        offsets = dict.fromkeys(present, 0)
        starts, total = {}, 0
        for r in present:
            starts[r] = total
            total += sum(s[r] for s in sizes)
        order = []
        for step in sizes:
            for r in present:
                begin = starts[r] + offsets[r]
                order.extend(range(begin, begin + step[r]))
                offsets[r] += step[r]
        index = np.asarray(order, dtype=np.int64)
        return keras.tree.map_structure(lambda *leaves: np.concatenate(leaves)[index], *[parts[r] for r in present])

    # ------------------------------------------------------------- on_batch
    def _cut(self, batch: tuple, training: bool):
        rows = num_rows(*[b for b in batch if b is not None][:1])
        plan = self.parallel.balancer.planner.plan(rows, for_step=training)
        begin, end = plan.rows(self.rank)
        local = tuple(None if b is None else keras.tree.map_structure(lambda a: a[begin:end], b) for b in batch)
        return local, plan

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """One step on a global batch that every rank holds; returns the global logs."""
        sample_weight = _with_class_weight(y, sample_weight, class_weight, "train_on_batch")
        (lx, ly, lsw), _ = self._cut((x, y, sample_weight), training=True)
        self.parallel.timing.break_continuity()
        return self.keras["train_on_batch"](lx, ly, sample_weight=lsw, return_dict=return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        """Evaluates a global batch that every rank holds; returns the global loss and metrics."""
        (lx, ly, lsw), _ = self._cut((x, y, sample_weight), training=False)
        return self.keras["test_on_batch"](lx, ly, sample_weight=lsw, return_dict=return_dict)

    def predict_on_batch(self, x):
        """Predicts a global batch that every rank holds; every rank returns all rows."""
        (lx,), plan = self._cut((x,), training=False)
        out = self.keras["predict_on_batch"](lx)
        return self._gather([plan.sizes], out)


def _split(x, y, sample_weight, fraction):
    (tx, ty, tsw), (vx, vy, vsw) = validation_split((x, y, sample_weight), fraction)
    return (tx, ty, tsw), (vx, vy, vsw)
