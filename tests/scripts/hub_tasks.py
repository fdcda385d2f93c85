"""keras-hub tasks trained by their own ``fit``, compared with one plain process by the tests.

    python hub_tasks.py OUT.npz --plain          # one device, plain Keras
    multigpu run --devices cpu:0,cpu:1 --ratios 3,1 hub_tasks.py OUT.npz
    ... [--optimizer sgd|adamw] [--shard optimizer|gradients|weights]

Two tasks built from a config (no weights are downloaded), each trained 2
epochs at global batch 32 on 90 rows (the last batch ragged) through the
task's own ``fit``, which batches the arrays into a grain dataset and runs
the task's preprocessing:

- a ``BertTextClassifier`` with its preprocessor (a WordPiece tokenizer over
  a small vocabulary): ``fit`` on strings with ``validation_data``, then
  ``evaluate`` and ``predict`` on strings;
- a ``GPT2CausalLM`` without a preprocessor, on token arrays with the padding
  mask as sample weight; then ``evaluate``, ``predict`` and, on rank 0 (on
  every rank with ``--shard weights``: each layer gathers its weights),
  greedy ``generate``.

Writes weights, History, evaluations, predictions, generated tokens and how
often the classifier's preprocessing ran on this rank (rank R > 0:
OUT.rankR.npz).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import keras_hub
import numpy as np

ROWS, BATCH, SEQ = 90, 32, 12
WORDS = ["the", "a", "cat", "dog", "bird", "sat", "ran", "flew", "on", "mat", "tree", "fast", "slow", "big", "red"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def sentences(rng, n):
    """Sentences of 3 to 8 words; the label says which of three animals comes first."""
    texts, labels = [], []
    for _ in range(n):
        words = list(rng.choice(WORDS, size=rng.integers(3, 9)))
        texts.append(" ".join(words))
        first = next((w for w in words if w in ("cat", "dog", "bird")), "cat")
        labels.append(("cat", "dog", "bird").index(first))
    return np.array(texts), np.array(labels)


def classifier():
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=VOCAB)
    pre = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=SEQ)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=len(VOCAB), num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=SEQ, dropout=0.0)
    return keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=pre, dropout=0.0)


def causal_lm():
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=40, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=SEQ, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def tokens(rng):
    ids = rng.integers(1, 40, size=(ROWS, SEQ + 1)).astype("int32")
    lengths = rng.integers(4, SEQ + 1, size=ROWS)
    mask = np.arange(SEQ)[None, :] < lengths[:, None]
    x = {"token_ids": np.where(mask, ids[:, :-1], 0), "padding_mask": mask}
    y = np.where(mask, ids[:, 1:], 0)
    return x, y, mask.astype("float32")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--shard", default=None, choices=["optimizer", "gradients", "weights"])
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    a = p.parse_args()

    def optimizer():
        if a.optimizer == "adamw":
            return keras.optimizers.AdamW(1e-3, weight_decay=0.01)
        return keras.optimizers.SGD(0.05)

    rng = np.random.default_rng(3)
    texts, labels = sentences(rng, ROWS)
    vtexts, vlabels = sentences(rng, 40)
    x, y, sw = tokens(rng)
    rank, results = 0, {}

    def prepare(model):
        nonlocal rank
        if not a.plain:
            import multigpu

            model = multigpu.parallelize(model, timeout=90, shard=a.shard)
            rank = multigpu.rank()
        return model

    keras.utils.set_random_seed(6)
    model = prepare(classifier())
    calls = {"preprocess": 0}
    preprocess = model.preprocess_samples

    def counted(*args, **kwargs):
        calls["preprocess"] += 1
        return preprocess(*args, **kwargs)

    model.preprocess_samples = counted  # the task hands its grain pipeline this bound method
    model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(True),
                  metrics=["sparse_categorical_accuracy"])
    history = model.fit(texts, labels, batch_size=BATCH, epochs=2, validation_data=(vtexts, vlabels), verbose=0,
                        shuffle=False)
    results["classifier"] = np.concatenate([w.ravel() for w in model.get_weights()])
    results["classifier_history"] = json.dumps(history.history)
    results["classifier_evaluate"] = json.dumps(model.evaluate(vtexts, vlabels, batch_size=16, verbose=0,
                                                               return_dict=True))
    results["classifier_predict"] = model.predict(vtexts, batch_size=16, verbose=0)
    results["preprocess_calls"] = calls["preprocess"]

    keras.utils.set_random_seed(7)
    model = prepare(causal_lm())
    model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(True),
                  weighted_metrics=["sparse_categorical_accuracy"], sampler="greedy")
    routed = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
    keras_model = {n: vars(keras.Model).get(n) for n in routed}
    seen = []  # during fit: is keras.Model still Keras's own?
    watch = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: seen.append({n: vars(keras.Model).get(n) for n in routed} == keras_model))
    history = model.fit(x, y, sample_weight=sw, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                        callbacks=[watch])
    results["keras_model_unchanged"] = bool(seen) and all(seen)
    results["lm"] = np.concatenate([w.ravel() for w in model.get_weights()])
    results["lm_history"] = json.dumps(history.history)
    results["lm_evaluate"] = json.dumps(model.evaluate(x, y, sample_weight=sw, batch_size=BATCH, verbose=0,
                                                       return_dict=True))
    results["lm_predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    if rank == 0 or a.shard == "weights":  # (the weights in parts: every rank calls the model, each layer gathers)
        prompt = {"token_ids": x["token_ids"][:4], "padding_mask": x["padding_mask"][:4] & (np.arange(SEQ) < 3)}
        results["lm_generate"] = model.generate(prompt, stop_token_ids=None)["token_ids"]
    if not a.plain:  # Keras writes the task's own class; unparallelize gives the model its class back
        import zipfile

        import keras_hub

        import multigpu

        path = os.path.join(os.path.dirname(os.path.abspath(a.out)), "lm.keras")
        model.save(path)
        with zipfile.ZipFile(path) as z:
            results["saved_as"] = json.dumps(json.loads(z.read("config.json"))["registered_name"])
        results["class_while_parallel"] = json.dumps([type(model).__name__,
                                                      isinstance(model, keras_hub.models.GPT2CausalLM)])
        multigpu.unparallelize(model)
        results["class_after"] = type(model) is keras_hub.models.GPT2CausalLM
    np.savez(a.out if rank == 0 else f"{a.out}.rank{rank}.npz", **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
