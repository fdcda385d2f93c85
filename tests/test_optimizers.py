"""The block-wise optimizer update (``multigpu.backend.torch.optimizers``): Keras's results, bit for bit."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch

from multigpu._keras.ledger import Ledger
from multigpu.backend.torch import optimizers as blockwise

# shapes around the block size: smaller, several blocks with a ragged end, one element
SHAPES = [(3, blockwise.BLOCK // 3 + 7), (blockwise.BLOCK * 2 + 5,), (17, 9), (1,)]

CASES = {
    "sgd-momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd-nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.8, nesterov=True),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-3),
    "rmsprop-centered-momentum": lambda: keras.optimizers.RMSprop(1e-3, centered=True, momentum=0.5),
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adam-amsgrad": lambda: keras.optimizers.Adam(1e-3, amsgrad=True),
    "adamw-schedule": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(1e-3, 2, 0.5), weight_decay=0.01),
}


def _train(make, fast: bool, steps: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.normal(size=s).astype("float32")) for s in SHAPES]
    optimizer = make()
    optimizer.build(variables)
    if fast:
        assert blockwise.install(optimizer, Ledger())
    for _ in range(steps):
        grads = [torch.from_numpy(rng.normal(size=s).astype("float32")) for s in SHAPES]
        optimizer.apply(grads, variables)
    return [keras.ops.convert_to_numpy(v.value) for v in [*variables, *optimizer.variables]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_blockwise_update_equals_keras_bit_for_bit(case, monkeypatch):
    keras_state = _train(CASES[case], fast=False)
    cut = []
    original = blockwise._blocks
    monkeypatch.setattr(blockwise, "_blocks", lambda *t: (cut.append(t[0].numel()), original(*t))[1])
    blockwise_state = _train(CASES[case], fast=True)
    # the block-wise path ran, on every tensor at every step (not Keras's update as a fallback)
    assert sorted(cut) == sorted(int(np.prod(s)) for s in SHAPES * 4)
    assert len(keras_state) == len(blockwise_state)
    for a, b in zip(keras_state, blockwise_state):
        np.testing.assert_array_equal(a, b)


def test_other_optimizers_and_plain_sgd_keep_keras_update():
    for optimizer in (keras.optimizers.SGD(0.1), keras.optimizers.Adagrad(), keras.optimizers.Lion()):
        assert blockwise.install(optimizer, Ledger()) is False
        assert "_parallel_update_step" not in vars(optimizer)


def test_a_subclass_with_its_own_update_keeps_it():
    class Mine(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign(variable - gradient)

    variable = keras.Variable(np.ones((4,), "float32"))
    optimizer = Mine()
    optimizer.build([variable])
    assert blockwise.install(optimizer, Ledger()) is False
    optimizer.apply([torch.ones(4)], [variable])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), np.zeros(4, "float32"))


def test_gradients_it_cannot_block_go_to_keras_update():
    variable = keras.Variable(np.ones((6,), "float32"))
    optimizer = keras.optimizers.RMSprop(0.1)
    optimizer.build([variable])
    assert blockwise.install(optimizer, Ledger())
    grad = torch.arange(12, dtype=torch.float32)[::2]  # not contiguous
    optimizer.apply([grad], [variable])
    reference = keras.optimizers.RMSprop(0.1)
    ref_variable = keras.Variable(np.ones((6,), "float32"))
    reference.build([ref_variable])
    reference.apply([grad.clone()], [ref_variable])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), keras.ops.convert_to_numpy(ref_variable))
