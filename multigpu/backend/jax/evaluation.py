"""Test, predict and global metrics, for :class:`~multigpu.backend.jax.step.JaxSteps`.

A test step computes, in a compiled function, Keras's loss and metric updates
on this rank's rows; the metric states are summed over ranks in one XLA
all-reduce and the global logs read from the sums.  Prediction needs no sum:
each rank predicts its rows and the data path puts them back in order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np

from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import batch_rows
from multigpu.backend.jax.packing import flat

__all__ = ["Evaluation"]


class Evaluation:
    """Test, predict and metrics, for :class:`~multigpu.backend.jax.step.JaxSteps` (whose model, collectives,
    compiled-function timer and results it uses)."""

    # ---------------------------------------------------------- evaluation
    def _build_test(self) -> None:
        model = self.model
        metric_refs = list(model.metrics_variables)
        n_states = sum(int(np.prod(v.shape)) for v in metric_refs)

        def local(trainable, non_trainable, metrics, x, y, sample_weight):
            _, aux = model.compute_loss_and_updates(trainable, non_trainable, metrics, x, y, sample_weight,
                                                    training=False)
            unscaled, y_pred, non_trainable, metrics = aux
            _, metrics = _compat.update_metrics_variables(model, metrics, unscaled, x, y, y_pred, sample_weight)
            return non_trainable, metrics

        def results(summed):
            return self._results(summed, metric_refs, 0)

        self._test_local = jax.jit(local, donate_argnums=(2,))
        self._test_pack = jax.jit(lambda metrics: jnp.concatenate([jnp.zeros(0, jnp.float32), *flat(metrics)]))
        self._test_results = jax.jit(results)
        self._test_n = n_states
        self._test = True

    def _test_function(self, state, iterator):
        return self._batches(self._test_batch, state, iterator)

    def _test_batch(self, state, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        trainable, non_trainable, metrics = state
        rows = batch_rows(x)
        self._fresh = None
        if self.user_test_step is not None:
            logs, new_state, self._fresh = self.eager.test(state, data, rows)
            return logs, new_state
        if rows > 0:
            non_trainable, metrics = self._timed_first(
                "test", rows, lambda: self._test_local(trainable, non_trainable, metrics, x, y, sample_weight))
        summed = self.comm.reduce(self._test_pack(metrics), "summing the step's metrics")
        logs = self._test_results(summed)
        self._fresh = logs
        return logs, (trainable, non_trainable, metrics)

    # ---------------------------------------------------------- prediction
    def make_predict_function(self, force: bool = False):
        self._initialize()
        if self._predict is None or force:
            model = self.model
            step = model.predict_step  # a predict_step of the model's own is stateless code too

            def predict(state, data):
                outputs, non_trainable = step(state, data)
                return outputs, (state[0], non_trainable)

            self._predict = jax.jit(predict)
        self.model.predict_function = self._predict_function
        return self._predict_function

    def _predict_function(self, state, iterator):
        return self._batches(self._predict_batch, state, iterator, concatenate=True)

    def _predict_batch(self, state, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        if batch_rows(x) > 0:
            return self._predict(state, data)
        # No rows here: outputs with no rows, of the model's shapes (one zero row through the model).
        one = keras.tree.map_structure(lambda a: None if a is None else jnp.zeros((1, *a.shape[1:]), a.dtype), x)
        outputs, state = self._predict(state, (one,))
        return keras.tree.map_structure(lambda a: a[:0], outputs), state

    # ---------------------------------------------------------- metrics
    def get_metrics_result(self):
        """Global results; Keras's own (local) ones while JAX traces a function (a step, a shape inference)."""
        if isinstance(jnp.zeros(()), jax.core.Tracer):
            return self.keras_metrics_result()
        if self._fresh is None:
            self._fresh = self.driver.aside.epoch_results(self.keras_metrics_result, self._summed_results)
        if self._fresh is None:
            self._fresh = self._summed_results()
        return {k: np.asarray(v) if hasattr(v, "shape") and v.shape else float(v) for k, v in self._fresh.items()}

    def _summed_results(self) -> dict:
        """The results of the metric states summed over the ranks (eagerly: rare, and nothing to compile)."""
        refs = list(self.model.metrics_variables)
        summed = self.comm.reduce(jnp.concatenate([jnp.zeros(0, jnp.float32), *flat([v.value for v in refs])]),
                                  "summing metrics")
        return self._results(jnp.asarray(summed), refs, 0)

    def reset_metrics(self):
        self._fresh = None
        return self.keras_reset_metrics()
