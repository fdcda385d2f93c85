"""The test and predict steps of a parallel model on torch, its global metrics and logs (a part of
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
from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import batch_rows, own_method
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
            step = (keras.Model.test_step if self.user_test_step is None else self.user_test_step).__get__(self.model)
            with self.metrics.local_results():
                logs_local = step(data)
        elif self.weights is not None and self.weights.active:  # weights in parts: the layers' gathers, no rows
            self.model(x, training=False) if _compat.call_has_training_arg(self.model) else self.model(x)
        return self._sum_logs(logs_local, rows, [], "test")

    def predict_step(self, data):
        self._initialize()
        step = (own_method(type(self.model), "predict_step") or keras.Model.predict_step).__get__(self.model)
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        if batch_rows(x) > 0:
            return step(data)
        # No rows here: outputs with no rows, of the model's shapes (one zero row through the model).
        one = keras.tree.map_structure(
            lambda a: None if a is None else torch.zeros((1, *a.shape[1:]), dtype=a.dtype, device=a.device), x)
        out = step((one,))
        return keras.tree.map_structure(lambda a: a[:0], out)

    # ---------------------------------------------------------- metrics
    def _sum_logs(self, logs_local, rows: int, message: list[float], phase: str):
        """The global logs of a step whose logs are summed after it (a test step, a step of the model's own),
        in one sum with the step's ``message`` (none for a test step)."""
        vec = self.metrics.pack(logs_local, rows, message, phase)
        buf = self.comm.buffer(vec.numel() + 1)
        buf[:-1].copy_(vec)
        buf[-1] = 1.0
        with self.timing.waiting():
            summed = self.comm.reduce(buf, tag=1000 + vec.numel() % 1000, what="summing the step's logs",
                                      describe=lambda: f"the step's logs ({vec.numel()} values) after the step")
        return self._finish(summed[:-1].tolist(), phase, len(message))

    def _finish(self, summed: list[float], phase: str, n_message: int | None = None, adopt: dict | None = None):
        """The global logs of a sum; a training step's message (its last ``n_message`` values) read by the
        driver (``adopt``: another rank's shares, for a step this rank finishes with that rank's sum)."""
        n_message = self.driver.message.size if n_message is None else n_message
        logs, tail = self.metrics.unpack(summed, n_message, phase)
        if n_message:
            self.driver.finish(tail, summed, n_message, adopt)
        return logs

    # ---------------------------------------------------------- the metrics' hooks (recovery, the driver)
    def restore_metrics(self) -> None:
        self.metrics.restore()

    def take_over_metrics(self) -> None:
        self.metrics.take_over(self.comm)

    def metrics_from_zero(self) -> None:
        self.metrics.start_from_zero()

    def forget_results(self) -> None:
        self.metrics.invalidate()

    def get_metrics_result(self):
        """Global results (local inside a step, where the step makes them global itself)."""
        if self.metrics.updates_only:
            return {}
        if self.metrics.local or (self.comm.rejoined and not self._initialized):
            return self.keras_metrics_result()  # (Keras's build, on a rank that came back: the others are in a step)
        return self.metrics.global_results(self.driver.aside.epoch_results)

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
