"""Calls parallelize with each kind of bad input and prints `CASE: ErrorType: message`."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras

import multigpu


def model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


CASES = {
    "ratios_length": lambda: multigpu.parallelize(model(), ["cpu:0", "cpu:1"], ratios=[1, 2, 3]),
    "ratios_zero": lambda: multigpu.parallelize(model(), ["cpu:0", "cpu:1"], ratios=[0, 1]),
    "ratios_negative": lambda: multigpu.parallelize(model(), ["cpu:0", "cpu:1"], ratios=[-1, 1]),
    "ratios_nan": lambda: multigpu.parallelize(model(), ["cpu:0", "cpu:1"], ratios=[float("nan"), 1]),
    "ratios_inf": lambda: multigpu.parallelize(model(), ["cpu:0", "cpu:1"], ratios=[float("inf"), 1]),
    "ratios_string": lambda: multigpu.parallelize(model(), ["cpu:0", "cpu:1"], ratios="fast"),
    "devices_repeat": lambda: multigpu.parallelize(model(), ["cpu:0", "cpu:0"]),
    "devices_unknown": lambda: multigpu.parallelize(model(), ["tpu:0"]),
    "gpu_without_gpu": lambda: multigpu.parallelize(model(), [0, 1]),
    "not_a_model": lambda: multigpu.parallelize(object(), ["cpu:0"]),
    "timeout": lambda: multigpu.parallelize(model(), ["cpu:0"], timeout=-1),
    "gpus_zero": lambda: multigpu.multi_gpu_model(model(), gpus=0),
}


def twice():
    m = multigpu.parallelize(model(), ["cpu:0"])
    multigpu.parallelize(m, ["cpu:0"])


for name, case in [*CASES.items(), ("twice", twice)]:
    try:
        case()
        print(f"{name}: no error")
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}")
