"""The test and predict functions of a parallel model on TensorFlow (a part of :class:`.step.TensorFlowSteps`).

A test step sums this rank's metric states over ranks and reads the global
results from them; a rank with no rows sends its states unchanged.  With
``min_devices`` a loss during the sum takes the batch again over the ranks
left (:mod:`multigpu.backend.recovery`).  A predict step runs the model's own
``predict_step`` on this rank's rows (none: outputs with no rows, of the
model's shapes).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from multigpu import membership
from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import batch_rows
from multigpu.backend.tensorflow.tensors import flat, metric_results, one_row_of_zeros

__all__ = ["Evaluation"]


class Evaluation:
    """The test and predict functions, for :class:`~multigpu.backend.tensorflow.step.TensorFlowSteps` (whose
    model, collectives, recovery, ``_function`` and ``_batches`` they use)."""

    # ---------------------------------------------------------- evaluation
    def _build_test(self) -> None:
        model = self.model
        training_arg = _compat.call_has_training_arg(model)

        def local(x, y, sample_weight):
            y_pred = model(x, training=False) if training_arg else model(x)
            loss = _compat.compute_loss(model, x, y, y_pred, sample_weight, training=False)
            tracker = _compat.loss_tracker(model)
            if tracker is not None:
                tracker.update_state(loss, sample_weight=tf.shape(keras.tree.flatten(x)[0])[0])
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            return tf.concat([tf.zeros(0, tf.float32), *flat([v.value for v in model.metrics_variables])], 0)

        self._test_local = self._function(local)
        self._test_results = self._function(
            lambda summed: metric_results(model, summed, list(model.metrics_variables), 0), jit=False)
        self._test = True

    def _test_function(self, iterator):
        return self._batches(self._test_batch, iterator)[-1]

    def _test_batch(self, data) -> dict:
        self._ready(data)
        if self._test is None:
            self._build_test()
        self._fresh = None
        if self.user_test_step is not None:
            x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            logs, self._fresh = self.custom.test(data, batch_rows(x))
            return logs
        summed = self.driver.evaluate(data, self._test_sum)
        self._summed_states = np.array(summed)
        logs = self._test_results(tf.constant(summed))
        self._fresh = logs
        return logs

    def _test_sum(self, data) -> np.ndarray:
        """This rank's metric states after its rows of the batch, summed over ranks."""
        membership.at("validation", self.comm.rank)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        states = self._test_local(x, y, sample_weight).numpy() if batch_rows(x) > 0 else self._states()
        return self.comm.reduce(states, "summing the step's metrics")

    # ---------------------------------------------------------- prediction
    def make_predict_function(self, force: bool = False):
        if self._predict is None or force:
            model = self.model
            def predict(data):
                return model.predict_step(data)

            self._predict = self._function(predict)
        self.model.predict_function = self._predict_function
        return self._predict_function

    def _predict_function(self, data: list):
        """Keras's TensorFlow ``predict`` hands over a list of ``steps_per_execution`` batches."""
        outputs = [self._predict_batch(batch) for batch in data]
        if len(outputs) == 1:
            return outputs[0]
        return keras.tree.map_structure(lambda *parts: tf.concat(parts, 0), *outputs)

    def _predict_batch(self, batch):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        if not self._initialized:  # an unbuilt model (no target to build its metrics with): its layers from one row
            if not self.model.built:
                self.model(one_row_of_zeros(x), training=False)
            self._initialize()
        if batch_rows(x) > 0:
            return self._predict(batch)
        # No rows here: outputs with no rows, of the model's shapes (one zero row through the model).
        outputs = self._predict((one_row_of_zeros(x),))
        return keras.tree.map_structure(lambda a: a[:0], outputs)
