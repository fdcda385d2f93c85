"""The states a TensorFlow step changes, kept and put back (recovery's hooks), and the global metric results.

Part of :class:`.step.TensorFlowSteps`: with ``min_devices`` each step keeps
this rank's metric states and non-trainable variables (and, for a step of the
model's own, whose logs are summed after its updates, what those updates
change) before its sum, so that :mod:`multigpu.backend.recovery` can take it
again after a loss; the lost ranks' counts are taken over from the last
global metric states read.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from multigpu import failure
from multigpu.backend.recovery import counts_after_loss
from multigpu.backend.tensorflow.tensors import metric_results

__all__ = ["States"]


class States:
    """Recovery's hooks and the metric results, for :class:`~multigpu.backend.tensorflow.step.TensorFlowSteps`."""

    # ---------------------------------------------------------- recovery's hooks (backend/recovery.py)
    def snapshot(self) -> list:
        self._kept_metrics = self._states()
        return [(v, v.numpy()) for v in self.model.non_trainable_variables]

    def restore_forward(self, kept: list | None) -> None:
        for v, value in kept or ():
            v.assign(value)

    def restore_metrics(self) -> None:
        if self._kept_metrics is not None:
            self._load_states(self._kept_metrics)

    def undo_updates(self) -> None:
        for v, value in self._kept_updates or ():
            v.assign(value)
        self._kept_updates = None

    def take_over_metrics(self) -> None:
        """Every rank back to its metric states before the step; the leader adds what the lost ranks had
        counted (the last sum less the survivors' part), so that the global results go on as before."""
        if self._kept_metrics is None:
            return
        summed = None if self._summed_states is None else self._summed_states.tolist()
        self._load_states(np.asarray(counts_after_loss(self.comm, self._kept_metrics.tolist(), summed), np.float32))

    def metrics_from_zero(self) -> None:
        if self._kept_metrics is not None:
            self._kept_metrics = np.zeros_like(self._kept_metrics)

    def finish_sum(self, summed: list[float], n_timing: int, adopt: dict):
        """This rank's training step finished with another rank's sum: its metric states (the first
        ``n_timing`` values, as :meth:`_train_on` noted them) give the logs, the rest the step's record."""
        if self.user_train_step is not None:
            failure.fail("a sum of a train_step of the model's own reached some ranks only before a rank was lost; "
                         "on TensorFlow such a step cannot be finished with another rank's sum, so the run ends")
        values = np.asarray(summed, np.float32)
        states, message = values[:n_timing], values[n_timing:]
        self._summed_states = states
        logs = metric_results(self.model, tf.constant(states), list(self.model.metrics_variables), 0)
        self.driver.finish(message, adopt=adopt)
        return logs

    def _load_states(self, values: np.ndarray) -> None:
        offset = 0
        for v in self.model.metrics_variables:
            n = int(np.prod(v.shape))
            v.assign(np.reshape(values[offset : offset + n], v.shape).astype(v.dtype))
            offset += n
        self._fresh = None

    # ---------------------------------------------------------- metrics
    def _states(self) -> np.ndarray:
        """The model's metric states now, as one float32 vector."""
        return np.concatenate([np.zeros(0, np.float32),
                               *(np.asarray(v.numpy(), np.float32).reshape(-1) for v in self.model.metrics_variables)])

    def get_metrics_result(self):
        """Global results; Keras's own (local) ones while TensorFlow traces a function or a step runs eagerly."""
        if tf.inside_function() or self._local_results:
            return self.keras_metrics_result()
        if self._fresh is None:
            self._fresh = self.driver.aside.epoch_results(self.keras_metrics_result, self._summed_results)
        if self._fresh is None:
            self._fresh = self._summed_results()
        return {k: np.asarray(v) if np.ndim(v) else float(v) for k, v in self._fresh.items()}

    def _summed_results(self) -> dict:
        """The results of the metric states summed over the ranks (eagerly: rare)."""
        summed = self.comm.reduce(self._states(), "summing metrics")
        return metric_results(self.model, tf.constant(summed), list(self.model.metrics_variables), 0)

    def reset_metrics(self):
        self._fresh = None
        return self.keras_reset_metrics()
