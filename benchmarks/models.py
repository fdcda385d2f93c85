"""Models shared by the benchmarks (built fresh on each call, not compiled).

    from benchmarks.models import convnet, mlp
    model = convnet(width=0.125)   # a narrow net for quick runs
"""

from __future__ import annotations

import keras

__all__ = ["convnet", "mlp"]


def _filters(n: int, width: float) -> int:
    return max(1, round(n * width))


def convnet(width: float = 1.0, input_shape: tuple[int, int, int] = (28, 28, 1), classes: int = 10):
    """The convolutional network of the original Keras multi-GPU MNIST example.

    Conv2D(32,3) relu, Conv2D(256,3) relu, BatchNormalization, Conv2D(128,3)
    relu, MaxPooling2D(2), Dropout(0.25), Flatten, Dense(128) relu,
    Dropout(0.5), Dense(classes) softmax.

    Args:
        width: scales the filter counts of the three convolutions (1.0 = the
            original 32/256/128); the dense layers are unchanged.
        input_shape: image shape, channels last.
        classes: number of output classes.

    Returns:
        An uncompiled functional ``keras.Model``.
    """
    layers = keras.layers
    inputs = keras.Input(input_shape)
    h = layers.Conv2D(_filters(32, width), 3, activation="relu")(inputs)
    h = layers.Conv2D(_filters(256, width), 3, activation="relu")(h)
    h = layers.BatchNormalization()(h)
    h = layers.Conv2D(_filters(128, width), 3, activation="relu")(h)
    h = layers.MaxPooling2D(2)(h)
    h = layers.Dropout(0.25)(h)
    h = layers.Flatten()(h)
    h = layers.Dense(128, activation="relu")(h)
    h = layers.Dropout(0.5)(h)
    outputs = layers.Dense(classes, activation="softmax")(h)
    return keras.Model(inputs, outputs, name="convnet")


def mlp(input_dim: int = 784, hidden: int = 1024, classes: int = 10):
    """A 784-1024-1024-10 multilayer perceptron (relu, softmax output).

    Args:
        input_dim: number of input features (flat vectors).
        hidden: units of each of the two hidden layers.
        classes: number of output classes.

    Returns:
        An uncompiled ``keras.Sequential`` model.
    """
    return keras.Sequential(
        [
            keras.Input((input_dim,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(classes, activation="softmax"),
        ],
        name="mlp",
    )
