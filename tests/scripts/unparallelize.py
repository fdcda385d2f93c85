"""Parallelizes a model with BatchNorm (global statistics) and a BackupAndRestore, trains it, makes it plain
again with ``multigpu.unparallelize``, trains it on this process's device alone, and writes what it found.

    python unparallelize.py OUT --devices cpu:0,cpu:1

Every rank writes ``OUT.rank<r>.json``: whether the model, its optimizer, its BatchNorm layers, the callback and
``keras.saving`` hold Keras's own again, whether any Keras class changed during the run, and the weights after
the plain fit.
"""

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
from seeding import set_random_seed

CLASSES = (keras.Model, keras.Sequential, keras.layers.Layer, keras.layers.BatchNormalization,
           keras.optimizers.Optimizer, keras.optimizers.SGD, keras.callbacks.BackupAndRestore)


def class_state() -> dict:
    return {c.__qualname__: {k: id(v) for k, v in vars(c).items()} for c in CLASSES}


def ours(obj) -> list[str]:
    """The instance attributes of ``obj`` that multigpu's code made (functions and methods of its modules)."""
    return sorted(k for k, v in vars(obj).items() if str(getattr(v, "__module__", "")).startswith("multigpu"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", default="cpu:0,cpu:1")
    a = p.parse_args()
    import multigpu

    before = class_state()
    saving = (keras.saving.save_model, keras.saving.save_weights)
    set_random_seed(2)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    model = multigpu.parallelize(model, devices=a.devices.split(","), sync_batchnorm=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")
    folder = os.path.dirname(os.path.abspath(a.out))
    backup = keras.callbacks.BackupAndRestore(os.path.join(folder, "backup"))
    backup_own = dict(vars(backup))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[backup])
    rank = multigpu.rank()
    during = class_state() == before
    set_on_model = ours(model)
    plain = multigpu.unparallelize(model)
    bn = plain.layers[1]
    found = {
        "same_object": plain is model,
        "set_on_model_while_parallel": set_on_model,
        "left_on_model": ours(model),
        "fit_is_keras": type(model).fit is getattr(model.fit, "__func__", None),
        "optimizer_own": sorted(k for k in ("apply", "_parallel_update_step", "_multigpu_sync", "_multigpu_blockwise")
                                if k in vars(model.optimizer)),
        "moments_own": "_moments" in vars(bn),
        "backup_changed": sorted(k for k in ("_save_model", "delete_checkpoint")
                                 if vars(backup).get(k, "absent") is not backup_own.get(k, "absent")),
        "saving_is_keras": (keras.saving.save_model, keras.saving.save_weights) == saving,
        "classes_unchanged_during_run": during,
        "classes_unchanged_after": class_state() == before,
        "state_refused": False,
    }
    try:
        multigpu.state(model)
    except ValueError:
        found["state_refused"] = True
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # this process alone: no collective
    found["weights"] = [w.tolist() for w in model.get_weights()]
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main()
