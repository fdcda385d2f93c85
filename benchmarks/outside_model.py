"""A model that multigpu's own benchmarks and tests do not contain, for checking balancing on it.

    multigpu bench --model benchmarks/outside_model.py:build --devices cpu:0 cpu:1@0.5 --ratios auto

A 32x32x3 convnet (Conv 32-64, MaxPool, Conv 128-128, GlobalAveragePooling, Dense 10), the
model on which automatic shares once reached 0.76x of the best fixed ratio.  Nothing in
multigpu was tuned on it: ``benchmarks/bench_balance.py`` runs it beside the built-in models.
"""

import keras
from keras import layers


def build() -> keras.Model:
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(128, 3, padding="same", activation="relu"),
        layers.Conv2D(128, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(10),
    ], name="outside_convnet")


# Three more shapes nothing in multigpu was tuned on either (``bench_fresh_auto.py --models``): the input shape of
# each builder is in INPUTS.
def build_wide() -> keras.Model:
    """A wider convnet on smaller images, 16x16x3 (Conv 64-128, MaxPool, Conv 256-256): about the outside
    convnet's work a row, over four times its weights (1.0M)."""
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.Conv2D(128, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(256, 3, padding="same", activation="relu"),
        layers.Conv2D(256, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(10),
    ], name="outside_wide_convnet")


def build_mlp() -> keras.Model:
    """An MLP on 784 features (1024-1024-10, 1.9M weights): little work a row beside a large sum."""
    return keras.Sequential([
        keras.Input((784,)),
        layers.Dense(1024, activation="relu"),
        layers.Dense(1024, activation="relu"),
        layers.Dense(10),
    ], name="outside_mlp")


def build_gru() -> keras.Model:
    """A GRU classifier on sequences of 32 steps of 16 features (GRU 128, Dense 10): a step's work is a loop over
    time."""
    return keras.Sequential([
        keras.Input((32, 16)),
        layers.GRU(128),
        layers.Dense(10),
    ], name="outside_gru")


BUILDERS = {"convnet": build, "wide": build_wide, "mlp": build_mlp, "gru": build_gru}
INPUTS = {"convnet": (32, 32, 3), "wide": (16, 16, 3), "mlp": (784,), "gru": (32, 16)}
BATCHES = {"convnet": 128, "wide": 128, "mlp": 512, "gru": 256}  # global batches of about 0.05 to 0.5 s a step
# Steps an epoch in ``bench_fresh_auto.py``: epochs of about 4 to 8 s on ``cpu:0`` + ``cpu:1@0.5``. At 16 steps the
# MLP's and the GRU's epochs last about 1 s, which holds no window of the share search (at least 1.5 s) and which the
# machine's noise swamps (their fixed ratios spread 15% to 33% between runs).
STEPS = {"convnet": 16, "wide": 16, "mlp": 64, "gru": 48}
