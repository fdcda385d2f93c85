"""Global metric results from summed states, in one process (torch backend)."""

import keras
import numpy as np
import pytest
import torch

from multigpu._keras import compat as _compat
from multigpu.backend.torch.metrics import GlobalMetrics


def two_outputs(metrics, weighted_metrics=None):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, {"a": keras.layers.Dense(3, activation="softmax", name="a")(h),
                                 "b": keras.layers.Dense(1, name="b")(h)})
    model.compile(optimizer="sgd", loss={"a": "sparse_categorical_crossentropy", "b": "mse"},
                  metrics=metrics, weighted_metrics=weighted_metrics)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = {"a": rng.integers(0, 3, size=(32,)), "b": rng.normal(size=(32, 1)).astype("float32")}
    model.fit(x, y, sample_weight=rng.uniform(0.5, 2, size=(32,)).astype("float32"), batch_size=16, verbose=0)
    return model


def compile_metrics(model):
    return next(m for m in model.metrics if type(m).__name__ == "CompileMetrics")


def test_named_results_follow_keras_names_with_outputs_clashes_and_weighted_metrics():
    model = two_outputs({"a": ["accuracy", "accuracy"], "b": ["mae"]}, weighted_metrics={"a": ["accuracy"]})
    cm = compile_metrics(model)
    names = [name for name, _ in _compat.named_results(cm)]
    assert names == list(cm.result())
    assert "a_accuracy_1" in names and "a_weighted_accuracy" in names  # both of Keras's renamings happen here


def test_plain_means_are_read_from_summed_states_exactly_as_result_computes_them():
    model = two_outputs({"a": ["accuracy"], "b": ["mae"]}, weighted_metrics={"b": ["mse"]})
    gm = GlobalMetrics(model, comm=None)
    states = gm.vector()
    summed = (states * 3 + torch.arange(states.numel())).tolist()  # another rank's states added
    fast = gm.results(summed)
    assert gm._plan is not None  # every metric here is a plain mean
    reference = gm._results(summed)
    assert list(fast) == list(reference)
    for k in reference:
        assert fast[k].dtype == torch.float32 and fast[k].item() == reference[k].item(), k
    assert gm.vector().tolist() == states.tolist()  # the local states are untouched


def test_a_count_of_zero_gives_zero_as_keras_does():
    model = two_outputs({"a": ["accuracy"], "b": ["mae"]})
    gm = GlobalMetrics(model, comm=None)
    zeros = [0.0] * gm.vector().numel()
    assert all(v.item() == 0.0 for v in gm.results(zeros).values())
    assert gm._plan is not None


@pytest.mark.parametrize("metric", [keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision")])
def test_any_other_metric_takes_keras_own_result(metric):
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(inputs))
    model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy", metric])
    rng = np.random.default_rng(1)
    model.fit(rng.normal(size=(32, 6)).astype("float32"), rng.integers(0, 2, size=(32, 1)).astype("float32"),
              verbose=0)
    gm = GlobalMetrics(model, comm=None)
    summed = (gm.vector() * 2).tolist()
    results = gm.results(summed)
    assert gm._plan is None
    assert {k: v.item() for k, v in results.items()} == {k: v.item() for k, v in gm._results(summed).items()}
