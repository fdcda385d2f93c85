"""A keras-hub text classifier, with its own tokenizer, trained on every device by the task's own ``fit``.

    KERAS_BACKEND=torch python examples/keras_hub_classifier.py --devices cpu:0,cpu:1 --ratios 3,1
    KERAS_BACKEND=torch python examples/keras_hub_classifier.py --quick      # about a minute on 2 CPU cores

A ``BertTextClassifier`` built from a config (nothing is downloaded): a WordPiece tokenizer over this example's
small vocabulary, its ``BertTextClassifierPreprocessor`` and a 2-layer ``BertBackbone``.  The data are sentences
made up here: the label says whether a sentence has more of the words ``good``, ``great``, ``fine`` than of
``bad``, ``awful``, ``poor``.  ``fit``, ``evaluate`` and ``predict`` take the raw strings, as on one device: the
task tokenises and packs each global batch once per machine, and multigpu cuts it by the shares.  Prints the
shares, samples/s, the test accuracy and a few predictions; rank 0 saves the task (``bert-classifier.keras``).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import keras_hub
import numpy as np
from _common import add_device_arguments, apply_quick_defaults

import multigpu

GOOD, BAD = ["good", "great", "fine"], ["bad", "awful", "poor"]
OTHER = ["the", "a", "film", "plot", "was", "and", "acting", "music", "very", "quite", "story", "ending", "cast"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *GOOD, *BAD, *OTHER]


def sentences(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` sentences of 4 to 12 words and their labels (1: more good words than bad ones)."""
    texts, labels = [], []
    for _ in range(n):
        words = list(rng.choice(OTHER, size=rng.integers(2, 8)))
        good, bad = int(rng.integers(0, 4)), int(rng.integers(0, 4))
        if good == bad:
            good += 1
        words += list(rng.choice(GOOD, size=good)) + list(rng.choice(BAD, size=bad))
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(int(good > bad))
    return np.array(texts), np.array(labels)


def build(hidden: int) -> keras_hub.models.BertTextClassifier:
    """The task from a config: tokenizer, preprocessor (32 tokens) and a 2-layer backbone."""
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=VOCAB)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=32)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=len(VOCAB), num_layers=2, num_heads=2,
                                             hidden_dim=hidden, intermediate_dim=2 * hidden, max_sequence_length=32)
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=preprocessor)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_arguments(p)
    p.add_argument("--rows", type=int, default=None, help="training sentences (default 8192; 2048 with --quick)")
    p.add_argument("--hidden", type=int, default=None, help="the backbone's width (default 64; 32 with --quick)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--epochs", type=int, default=None, help="default 3 (2 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer sentences and a narrower model: about a minute")
    a = p.parse_args(argv)
    apply_quick_defaults(a, {"rows": (8192, 2048), "hidden": (64, 32), "epochs": (3, 2)})
    if min(a.rows, a.hidden, a.batch_size, a.epochs) < 1:
        p.error("--rows, --hidden, --batch-size and --epochs must be positive")
    return a


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(0)
    x_train, y_train = sentences(rng, args.rows)
    x_test, y_test = sentences(rng, 512)
    keras.utils.set_random_seed(1)
    model = multigpu.parallelize(build(args.hidden), devices=args.devices, ratios=args.ratios)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(True),
                  metrics=["sparse_categorical_accuracy"])
    state = multigpu.state(model)
    rank0 = multigpu.rank() == 0
    if rank0:
        print(state.describe(), flush=True)
    began = time.perf_counter()
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2 if rank0 else 0)
    seconds = time.perf_counter() - began
    _, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    probabilities = keras.ops.softmax(model.predict(x_test[:3], batch_size=3, verbose=0))
    if rank0:
        print(f"trained {args.epochs} epochs of {args.rows} sentences in {seconds:.1f} s "
              f"({args.epochs * args.rows / seconds:.0f} samples/s) on {state.world_size} device(s)")
        print(f"test accuracy: {accuracy:.3f}")
        for text, p in zip(x_test[:3], keras.ops.convert_to_numpy(probabilities)):
            print(f"  {p[1]:.2f} good: {text}")
    model.save("bert-classifier.keras")  # rank 0 writes it; every rank returns once it is there
    if rank0:
        print("saved bert-classifier.keras")


if __name__ == "__main__":
    main()
