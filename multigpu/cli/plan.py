"""``multigpu plan``: what each device holds of a model's training state at each level of ``shard``, and the
largest model the devices hold together.

    multigpu plan --memory 24GiB,12GiB --weights 1.2e9 --optimizer adamw
    multigpu plan --devices cpu:0/8GiB cpu:1/4GiB --model model.keras
    multigpu plan --devices cuda:0 cuda:1 --weights 350M

Pure arithmetic, nothing runs: per device the weights, the gradients it keeps
and the optimizer state it holds (its part follows its memory where every
device's is known, as ``parallelize`` cuts it), against its memory (``--memory``,
a CPU device's given size, or a GPU's as torch reports it).  The same
arithmetic as the check ``fit`` makes before its first step.  The steps'
activations come on top: the largest global batch is measured, not computed
(``multigpu calibrate`` runs the model at growing batches on each device).
"""

from __future__ import annotations

import argparse
import re
import warnings

_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="what each device holds of a model's training state, and the largest model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", "--gpus", default=None,
                   help="devices, e.g. cpu:0/8GiB cpu:1/4GiB or cuda:0 cuda:1 (their memory: a CPU device's size, "
                        "a GPU's own)")
    p.add_argument("--memory", default=None, help="each device's memory, e.g. 24GiB,12GiB (instead of the devices')")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--weights", help="trainable weights, e.g. 1.2e9, 350M or 7B")
    what.add_argument("--model", help="a saved model (.keras): its weights and, where compiled, its optimizer")
    p.add_argument("--optimizer", default=None, help="a Keras optimizer's name (default: the model's, else adam)")
    p.add_argument("--dtype", default="float32", choices=sorted(_ITEMSIZE), help="the weights' dtype")
    p.set_defaults(func=run)


def parse_count(text: str) -> int:
    """``"1.2e9"``, ``"350M"``, ``"7B"``, ``"1200000"`` -> a count; a clear error otherwise."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbg]?)\s*", text.lower())
    if found is None or float(found.group(1)) * _SCALE[found.group(2)] < 1:
        raise ValueError(f"--weights takes a positive count, e.g. 1.2e9, 350M or 7B. Received: {text!r}")
    return int(float(found.group(1)) * _SCALE[found.group(2)])


def _devices(args) -> tuple[list[str], list[int | None]]:
    from multigpu.devices import parse_size

    labels: list[str] = []
    memory: list[int | None] = []
    if args.devices:
        from multigpu import backend
        from multigpu.devices import parse_devices

        facts = backend.facts()
        for d in parse_devices(args.devices, num_gpus=backend.gpu_count):
            labels.append(d.label)
            memory.append(facts.gpu_info(d.index).get("total_memory") if d.is_cuda else d.memory)
    if args.memory:
        sizes = [parse_size(s) for s in args.memory.split(",")]
        if labels and len(sizes) != len(labels):
            raise ValueError(f"--memory takes one size per device ({len(labels)} devices). "
                             f"Received: --memory {args.memory}")
        labels = labels or [f"device {r}" for r in range(len(sizes))]
        memory = list(sizes)
    if len(labels) < 2:
        raise ValueError("plan takes two devices or more: --devices cpu:0/8GiB cpu:1/4GiB, or --memory "
                         f"24GiB,12GiB. Received: --devices {args.devices!r}, --memory {args.memory!r}")
    return labels, memory


def _model(args) -> tuple[int, int, str, float]:
    """``(trainable weights, bytes of the weights that are not trained, the optimizer's name, its values a
    weight)``."""
    import keras

    from multigpu._keras.model_parts import optimizer_slots

    itemsize = _ITEMSIZE[args.dtype]
    optimizer, trainable, frozen = None, 0, 0
    if args.model:
        with warnings.catch_warnings():  # an optimizer saved before it was built: its values are not needed here
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            model = keras.saving.load_model(args.model)
        trainable = sum(int(v.numpy().size) for v in model.trainable_weights)
        frozen = sum(int(v.numpy().size) for v in model.non_trainable_weights) * itemsize
        optimizer = getattr(model, "optimizer", None)
    else:
        trainable = parse_count(args.weights)
    if args.optimizer is not None or optimizer is None:
        try:
            optimizer = keras.optimizers.get(args.optimizer or "adam")
        except ValueError:
            raise ValueError(f"--optimizer takes a Keras optimizer's name (adam, adamw, sgd, rmsprop, ...). "
                             f"Received: {args.optimizer!r}") from None
    return trainable, frozen, type(optimizer).__name__, optimizer_slots(optimizer)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def run(args: argparse.Namespace) -> int:
    from multigpu.planning.footprint import LEVELS, SPELLING, holds, largest_model
    from multigpu.planning.partition import memory_weights

    labels, memory = _devices(args)
    trainable, frozen, name, slots = _model(args)
    itemsize = _ITEMSIZE[args.dtype]
    weights = memory_weights(memory)
    parts = [w / sum(weights) for w in weights]
    print(f"{trainable:,} trainable weights ({args.dtype}, {_gib(trainable * itemsize)}), {name}: "
          f"{slots:g} values a weight; each device's part of the state: "
          + ", ".join(f"{p:.0%}" for p in parts))
    width = max(len(s) for s in SPELLING.values()) + 2
    columns = [f"{label} ({_gib(m) if m is not None else 'memory unknown'})" for label, m in zip(labels, memory)]
    print(f"{'level':<{width}}" + "".join(f"{c:>30}" for c in columns) + "   fits")
    for level in LEVELS:
        held = [h + frozen for h in holds(level, trainable, itemsize, slots, parts)]
        fits = all(m is None or h <= m for h, m in zip(held, memory))
        print(f"{SPELLING[level]:<{width}}" + "".join(f"{_gib(h):>30}" for h in held) + f"   {'yes' if fits else 'no'}")
    for level in LEVELS:
        most = largest_model(level, [None if m is None else max(0, m - frozen) for m in memory], itemsize, slots,
                             parts)
        if most is not None:
            print(f"The largest model at {SPELLING[level]}: {most:,} trainable weights.")
    print("On TensorFlow and JAX the gradients and weights stay whole (shard='optimizer' is their most). At "
          "shard='weights' a device also gathers one layer's weights at a time. The steps' activations come on top "
          "of these figures: `multigpu calibrate` measures the largest batch each device holds.")
    return 0
