"""Callbacks on a parallel model: which run where, and the run's own epoch hooks.

Every rank runs Keras's loop with the same global logs, so most callbacks
take the same decisions everywhere (``EarlyStopping``, ``ReduceLROnPlateau``,
``LearningRateScheduler``, ``ModelCheckpoint``, whose saving writes once).
Writers run on rank 0 only (``CSVLogger``, ``TensorBoard``);
``BackupAndRestore`` restores on every rank and writes on rank 0 only.
"""

from __future__ import annotations

import keras

from multigpu._keras import compat as _compat

__all__ = ["EpochHooks", "for_rank"]


def for_rank(callbacks, rank: int, ledger) -> list:
    """The user's callbacks as rank ``rank`` runs them (what is changed on them noted in the model's ``ledger``)."""
    out = []
    for cb in list(callbacks or []):
        if rank != 0 and isinstance(cb, (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)):
            continue
        if rank != 0 and isinstance(cb, keras.callbacks.BackupAndRestore):
            _compat.silence_backup_saving(cb, ledger)
        out.append(cb)
    return out


class EpochHooks(keras.callbacks.Callback):
    """multigpu's own work at epoch boundaries; runs before the user's callbacks.

    At the beginning: the epoch's row order (the same on every rank), and a
    break in step timing (the gap holds validation and callbacks); at each
    batch, the run's position (where a rank that comes back starts).  At the
    end: BatchNorm statistics made equal on every rank (so that checkpoints
    and validation see the same model everywhere), rank 0's weights sent to
    all where the ranks run on different kinds of processor, and the
    balancer's epoch report.  Devices that do not pay are set aside at an
    epoch's start and come back at an epoch's or the fit's end
    (:mod:`multigpu.backend.parking`).
    """

    def __init__(self, parallel, data) -> None:
        super().__init__()
        self.parallel = parallel
        self.data = data

    def on_epoch_begin(self, epoch, logs=None):
        self.data.set_epoch(epoch)
        self.parallel.timing.break_continuity()
        self.parallel.position["epoch"], self.parallel.position["step"] = epoch, 0
        self.parallel.steps.driver.aside.epoch_begins(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self.parallel.position["step"] = self.data.first_step(self.parallel.position["epoch"]) + batch

    def on_epoch_end(self, epoch, logs=None):
        self.parallel.steps.driver.aside.epoch_ending()
        self.parallel.steps.sync_batchnorm_statistics()
        self.parallel.steps.realign_replicas()
        self.parallel.balancer.end_epoch(epoch)
        self.parallel.steps.driver.aside.epoch_ends(epoch)

    def on_train_end(self, logs=None):
        self.parallel.steps.driver.aside.fit_ends()
        self.parallel.steps.fit_ends()
