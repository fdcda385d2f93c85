"""Built-in models for ``multigpu bench``, ``multigpu calibrate`` and the examples.

Each entry builds an uncompiled Keras model, compiles it the way its original
script did, and makes synthetic data of its input shape (no downloads):

* ``convnet``: the convnet of the original Keras multi-GPU MNIST example;
* ``mlp``: 784-1024-1024-10;
* ``gru``: a stacked GRU classifier on sequences;
* ``maxing``: a convnet with far more layers than it needs, to load devices;
* ``dense41m``: the 41-million-parameter dense network (8000 inputs);
* ``bert``, ``gpt2``: small keras-hub backbones built from a config (2 layers,
  hidden 64, 32 tokens; needs keras-hub), a classifier and a causal language
  model on token ids;
* ``resnet50``, ``mobilenetv3small``, ``efficientnetb0``: ``keras.applications``
  models with ``weights=None`` on 32x32 images, 10 classes.

A user's own model is named ``path/to/file.py:build_fn``; ``build_fn()``
returns a Keras model (compiled or not).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["ModelSpec", "get_model", "names"]


@dataclass
class ModelSpec:
    """How to build, compile and feed one model."""

    name: str
    build: Callable[[float], object]
    data: Callable[[int, int], tuple]
    compile: Callable[[object], None]


def _w(n: int, width: float) -> int:
    return max(1, round(n * width))


def convnet(width: float = 1.0, input_shape=(28, 28, 1), classes: int = 10, head: int = 128):
    """The convnet of the Keras multi-GPU MNIST example (``width`` scales filters, ``head`` the dense layer)."""
    import keras

    L = keras.layers
    inputs = keras.Input(input_shape)
    h = L.Conv2D(_w(32, width), 3, activation="relu")(inputs)
    h = L.Conv2D(_w(256, width), 3, activation="relu")(h)
    h = L.BatchNormalization()(h)
    h = L.Conv2D(_w(128, width), 3, activation="relu")(h)
    h = L.MaxPooling2D(2)(h)
    h = L.Dropout(0.25)(h)
    h = L.Flatten()(h)
    h = L.Dense(head, activation="relu")(h)
    h = L.Dropout(0.5)(h)
    outputs = L.Dense(classes, activation="softmax")(h)
    return keras.Model(inputs, outputs, name="convnet")


def mlp(width: float = 1.0):
    import keras

    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(_w(1024, width), activation="relu"),
        keras.layers.Dense(_w(1024, width), activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], name="mlp")


def gru(width: float = 1.0, timesteps: int = 40, features: int = 16, classes: int = 4):
    """Stacked GRU classifier on sequences."""
    import keras

    return keras.Sequential([
        keras.Input((timesteps, features)),
        keras.layers.GRU(_w(64, width), return_sequences=True),
        keras.layers.GRU(_w(64, width)),
        keras.layers.Dense(classes, activation="softmax"),
    ], name="gru")


def maxing(width: float = 1.0, depth: int = 12):
    """A convnet with far more layers than it needs, built to load devices fully."""
    import keras

    layers = [keras.Input((32, 32, 3))]
    for _ in range(depth):
        layers.append(keras.layers.Conv2D(_w(64, width), 3, padding="same", activation="relu"))
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10, activation="softmax")]
    return keras.Sequential(layers, name="maxing")


def dense41m(width: float = 1.0):
    """Dense(4000, tanh) on 8000 inputs, 2000, 500, 300, 1 (about 41M parameters)."""
    import keras

    return keras.Sequential([
        keras.Input((8000,)),
        keras.layers.Dense(_w(4000, width), activation="tanh"),
        keras.layers.Dense(_w(2000, width), activation="relu"),
        keras.layers.Dense(_w(500, width), activation="relu"),
        keras.layers.Dense(_w(300, width), activation="relu"),
        keras.layers.Dense(1, activation="sigmoid"),
    ], name="dense41m")


SEQ, VOCAB = 32, 1000


def bert(width: float = 1.0, classes: int = 4):
    """keras-hub's ``BertBackbone`` (2 layers, hidden 64) under a ``Dense`` head, on token ids (0 pads)."""
    import keras
    import keras_hub

    tokens = keras.Input((SEQ,), dtype="int32", name="token_ids")
    backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                             hidden_dim=_w(64, width), intermediate_dim=_w(128, width),
                                             max_sequence_length=SEQ)
    pooled = backbone({"token_ids": tokens, "segment_ids": keras.ops.zeros_like(tokens),
                       "padding_mask": keras.ops.not_equal(tokens, 0)})["pooled_output"]
    return keras.Model(tokens, keras.layers.Dense(classes, activation="softmax")(pooled), name="bert")


def gpt2(width: float = 1.0):
    """keras-hub's ``GPT2Backbone`` (2 layers, hidden 64) with a next-token head, on token ids (0 pads)."""
    import keras
    import keras_hub

    tokens = keras.Input((SEQ,), dtype="int32", name="token_ids")
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                             hidden_dim=_w(64, width), intermediate_dim=_w(128, width),
                                             max_sequence_length=SEQ)
    hidden = backbone({"token_ids": tokens, "padding_mask": keras.ops.not_equal(tokens, 0)})
    return keras.Model(tokens, keras.layers.Dense(VOCAB)(hidden), name="gpt2")


def _tokens_data(next_token: bool, classes: int = 4):
    def make(rows: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        ids = rng.integers(1, VOCAB, size=(rows, SEQ + 1)).astype("int32")
        if next_token:
            return ids[:, :-1], ids[:, 1:].astype("int64")
        return ids[:, :-1], (ids[:, 0] % classes).astype("int64")
    return make


def application(name: str):
    """A ``keras.applications`` model with ``weights=None`` on 32x32x3 images, 10 classes."""
    def build(width: float = 1.0):
        import keras

        kwargs = {"dropout_rate": 0.0} if name == "MobileNetV3Small" else {}
        return getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=10, **kwargs)
    return build


def _classes_data(shape, classes, onehot=False):
    def make(rows: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(rows, *shape)).astype("float32")
        # a learnable label: which of `classes` equal slices of the input has
        # the largest sum (a linear feature of the whole input)
        flat = x.reshape(rows, -1)
        usable = flat[:, : flat.shape[1] - flat.shape[1] % classes]
        y = usable.reshape(rows, classes, -1).sum(axis=2).argmax(axis=1).astype("int64")
        if onehot:
            y = np.eye(classes, dtype="float32")[y]
        return x, y
    return make


def _binary_data(rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8000)).astype("float32")
    return x, (x[:, 0] > 0).astype("float32")[:, None]


def _logits_loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compile(loss, optimizer, metrics=("accuracy",)):
    """Compiles with ``loss`` (a name, or a function making the loss once Keras is imported)."""
    def apply(model):
        import keras

        opt = {"rmsprop": keras.optimizers.RMSprop, "adam": keras.optimizers.Adam,
               "sgd": keras.optimizers.SGD}[optimizer]()
        model.compile(optimizer=opt, loss=loss() if callable(loss) else loss, metrics=list(metrics))
    return apply


_BUILTIN = {
    "convnet": ModelSpec("convnet", convnet, _classes_data((28, 28, 1), 10, onehot=True),
                         _compile("categorical_crossentropy", "rmsprop")),
    # The convnet's body with a 4M-parameter dense head at width 0.5 (bench_network.py's model for links).
    "convnet_head": ModelSpec("convnet_head", lambda width=1.0: convnet(width, head=512),
                              _classes_data((28, 28, 1), 10, onehot=True), _compile("categorical_crossentropy",
                                                                                      "rmsprop")),
    "mlp": ModelSpec("mlp", mlp, _classes_data((784,), 10), _compile("sparse_categorical_crossentropy", "sgd")),
    "gru": ModelSpec("gru", gru, _classes_data((40, 16), 4), _compile("sparse_categorical_crossentropy", "adam")),
    "maxing": ModelSpec("maxing", maxing, _classes_data((32, 32, 3), 10),
                        _compile("sparse_categorical_crossentropy", "adam")),
    "dense41m": ModelSpec("dense41m", dense41m, _binary_data, _compile("binary_crossentropy", "adam")),
    "bert": ModelSpec("bert", bert, _tokens_data(False), _compile("sparse_categorical_crossentropy", "adam")),
    "gpt2": ModelSpec("gpt2", gpt2, _tokens_data(True),
                      _compile(_logits_loss, "adam", metrics=())),
    **{name.lower(): ModelSpec(name.lower(), application(name), _classes_data((32, 32, 3), 10),
                               _compile("sparse_categorical_crossentropy", "sgd"))
       for name in ("ResNet50", "MobileNetV3Small", "EfficientNetB0")},
}


def names() -> list[str]:
    """The built-in model names."""
    return sorted(_BUILTIN)


def _user_spec(text: str) -> ModelSpec:
    path, _, fn = text.rpartition(":")
    if not path or not fn or not Path(path).is_file():
        raise ValueError(
            f"Unknown model {text!r}. Use a built-in name ({', '.join(names())}) or "
            "path/to/file.py:build_fn."
        )
    spec = importlib.util.spec_from_file_location(f"multigpu_user_model_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    build = getattr(module, fn, None)
    if not callable(build):
        raise ValueError(f"{path} has no function {fn!r}. Received: --model {text}")
    probe: dict = {}

    def make_model(width: float):
        model = build()
        probe["model"] = model
        return model

    def data(rows: int, seed: int = 0):
        model = probe.get("model") or build()
        rng = np.random.default_rng(seed)
        in_shape = tuple(model.inputs[0].shape[1:])
        out_shape = tuple(model.outputs[0].shape[1:])
        return (rng.normal(size=(rows, *in_shape)).astype("float32"),
                rng.normal(size=(rows, *out_shape)).astype("float32"))

    return ModelSpec(text, make_model, data, _compile("mse", "adam", metrics=()))


def get_model(name: str) -> ModelSpec:
    """A built-in model by name, or a user's ``file.py:fn``."""
    if name in _BUILTIN:
        return _BUILTIN[name]
    return _user_spec(name)
