"""The test and predict steps of a parallel model on torch, and its global metrics (a part of
:class:`.step.TorchSteps`).

A test step sums this rank's metric states and logs over ranks (with
``min_devices``, a loss during the sum takes the batch again over the ranks
left: :mod:`multigpu.backend.recovery`); a predict step runs the model's own
``predict_step`` on this rank's rows (none: outputs with no rows, of the
model's shapes).  BatchNorm's moving statistics are averaged over ranks, by
share, at every epoch's end.
"""

from __future__ import annotations

import keras
import torch

from multigpu import membership
from multigpu._keras.model_parts import batch_rows
from multigpu.backend.torch.batchnorm import average_statistics

__all__ = ["Evaluation"]


class Evaluation:
    """Test, predict and metrics, for :class:`~multigpu.backend.torch.step.TorchSteps` (whose model,
    collectives, metrics and recovery they use)."""

    # ---------------------------------------------------------- evaluation
    def test_step(self, data):
        self._initialize()
        return self.driver.evaluate(data, self._test_on)

    def _test_on(self, data):
        membership.at("validation", self.comm.rank)
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        rows = batch_rows(x)
        self.metrics.invalidate()
        logs_local = None
        if rows > 0:
            step = self.keras_test_step if self.user_test_step is None else self.user_test_step.__get__(self.model)
            with self.metrics.local_results():
                logs_local = step(data)
        return self._sum_logs(logs_local, rows, [], "test")

    def predict_step(self, data):
        self._initialize()
        step = self.keras_predict_step if self.user_predict_step is None else self.user_predict_step.__get__(self.model)
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        if batch_rows(x) > 0:
            return step(data)
        # No rows here: outputs with no rows, of the model's shapes (one zero row through the model).
        one = keras.tree.map_structure(
            lambda a: None if a is None else torch.zeros((1, *a.shape[1:]), dtype=a.dtype, device=a.device), x)
        out = step((one,))
        return keras.tree.map_structure(lambda a: a[:0], out)

    # ---------------------------------------------------------- metrics
    def get_metrics_result(self):
        """Global results (local inside a step, where the step makes them global itself)."""
        if self.metrics.updates_only:
            return {}
        if self.metrics.local or (self.comm.rejoined and not self._initialized):
            return self.keras_metrics_result()  # (Keras's build, on a rank that came back: the others are in a step)
        return self.metrics.global_results()

    def reset_metrics(self):
        self.metrics.invalidate()
        self.metrics.forget()
        return self.keras_reset_metrics()

    def sync_batchnorm_statistics(self) -> None:
        """BatchNorm moving statistics averaged over ranks by share (no-op with global statistics)."""
        if self.sync_batchnorm:
            return
        ratios = self.balancer.ratios
        average_statistics(self.model, self.comm, ratios[self.comm.rank] / sum(ratios))
