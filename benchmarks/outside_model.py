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
