"""What the first training step adds to each device's memory, and the check that ends a run that cannot hold it
before its first step, in-process (tests/test_memory.py runs it on two real devices, in make test-outside)."""

from types import SimpleNamespace

import keras
import pytest

from multigpu._keras.model_parts import optimizer_slots
from multigpu.balancing.caps import DeviceMemory
from multigpu.devices import parse_devices
from multigpu.planning.footprint import Footprint

MIB = 1 << 20


def test_each_level_adds_the_gradients_it_keeps_and_the_optimizer_state_it_holds():
    # two variables of 100 and 50 float32 values, Adam (2 values a weight), rank 0 owning the first
    footprint = Footprint.of([100, 50], [4, 4], 2.0, [0, 1], 2, built=False)
    assert (footprint.gradients, footprint.state, list(footprint.owned)) == (600, 1200, [800, 400])
    assert [footprint.adds(level, 0) for level in ("whole", "optimizer", "gradients")] == [1800, 1400, 800]
    assert [footprint.adds(level, 1) for level in ("whole", "optimizer", "gradients")] == [1800, 1000, 400]
    built = Footprint.of([100, 50], [4, 4], 2.0, [0, 1], 2, built=True)  # its state is held already
    assert [built.adds(level, 0) for level in ("whole", "optimizer", "gradients")] == [600, 600, 0]
    assert Footprint.of([10], [2], 1.0, [1], 2, built=False).owned == [0, 20]  # bfloat16: 2 bytes a value
    # weights in parts: its optimizer state, the largest variable gathered, less the weights it does not own
    assert [footprint.adds("weights", r) for r in (0, 1)] == [800 + 400 - 200, 400 + 400 - 400]
    with pytest.raises(ValueError, match=r"must be one of whole, optimizer, gradients, weights\. Received: 'parts'"):
        footprint.adds("parts", 0)


class _Unrebuildable(keras.optimizers.SGD):
    def __init__(self, required, **kwargs):
        super().__init__(**kwargs)
        self.required = required


def test_an_optimizers_values_per_weight_are_read_from_a_copy_built_on_a_probe():
    assert optimizer_slots(keras.optimizers.Adam()) == 2
    assert optimizer_slots(keras.optimizers.Adam(amsgrad=True)) == 3
    assert optimizer_slots(keras.optimizers.SGD()) == 0
    assert optimizer_slots(keras.optimizers.SGD(momentum=0.9)) == 1
    assert optimizer_slots(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())) == 2
    assert optimizer_slots(keras.optimizers.Adam(gradient_accumulation_steps=2)) == 3
    optimizer = keras.optimizers.Adam()
    assert optimizer_slots(optimizer) == 2 and not optimizer.built  # the user's own is left as it was
    assert optimizer_slots(_Unrebuildable(required=1)) == 0  # its config does not rebuild it: nothing counted


def _memory(devices: str, lefts: list) -> DeviceMemory:
    parsed = parse_devices(devices.split(","))
    comm = SimpleNamespace(rank=0, world_size=len(parsed), leader=0, runtime=SimpleNamespace(devices=parsed),
                           gather_objects=lambda obj, what: list(lefts))
    return DeviceMemory(comm, balancer=None)


def test_a_device_that_cannot_hold_the_first_step_ends_the_run_naming_its_memory_and_the_level_that_fits():
    # 32 MiB of weights, Adam, rank 0 owning half the state: whole 96 MiB, optimizer 64 MiB, gradients 32 MiB
    footprint = Footprint.of([4 * MIB, 4 * MIB], [4, 4], 2.0, [0, 1], 2, built=False)
    memory = _memory("cpu:0/64MiB,cpu:1", [int(62.5 * MIB), None])
    with pytest.raises(ValueError) as error:
        memory.check_state(footprint, "whole", ["whole", "optimizer", "gradients"])
    assert str(error.value) == (
        "the training state does not fit at shard_optimizer=False: CPU:0 (64MiB given) has 62.5 MiB left after the "
        "weights, and the first step adds 96.0 MiB (gradients 32.0 MiB, optimizer state 64.0 MiB). "
        "shard='gradients' fits: the first step adds 32.0 MiB on CPU:0; give parallelize shard='gradients'.")
    memory.check_state(footprint, "gradients", ["whole", "optimizer", "gradients"])  # fits: nothing raised
    # a device that holds the weights but not one more copy of them: the weights in parts, owning none of them
    small = Footprint.of([4 * MIB, 4 * MIB], [4, 4], 2.0, [1, 1], 2, built=False)
    with pytest.raises(ValueError) as error:
        _memory("cpu:0/40MiB,cpu:1", [int(8 * MIB), None]).check_state(
            small, "optimizer", ["whole", "optimizer", "gradients", "weights"])
    assert str(error.value).endswith("shard='gradients' fits: the first step adds 0.0 MiB on CPU:0; give "
                                     "parallelize shard='gradients'.")
    # owning the state of 4 MiB of 36 MiB of weights (8 MiB): in parts it lets go of 32 and gathers 16 at least
    with pytest.raises(ValueError) as error:
        _memory("cpu:0/40MiB,cpu:1", [int(4 * MIB), None]).check_state(
            Footprint.of([4 * MIB, 4 * MIB, MIB], [4, 4, 4], 2.0, [1, 1, 0], 2, built=False), "gradients",
            ["whole", "optimizer", "gradients", "weights"])
    assert "shard='weights' fits: the first step adds -8.0 MiB on CPU:0" in str(error.value)
    _memory("cpu:0,cpu:1", [None, None]).check_state(footprint, "whole", ["whole"])  # no memory known: no check


def test_when_no_level_the_run_may_take_fits_the_error_says_how_much_more_the_least_needs():
    footprint = Footprint.of([4 * MIB, 4 * MIB], [4, 4], 2.0, [0, 1], 2, built=False)
    memory = _memory("cpu:0/64MiB,cpu:1/48MiB", [int(62.5 * MIB), int(47.5 * MIB)])
    with pytest.raises(ValueError) as error:  # TensorFlow and JAX: no gradients in parts
        memory.check_state(footprint, "optimizer", ["whole", "optimizer"])
    text = str(error.value)
    assert text.startswith("the training state does not fit at shard='optimizer': CPU:0 (64MiB given) has 62.5 MiB "
                           "left after the weights, and the first step adds 64.0 MiB")
    assert "; CPU:1 (48MiB given) has 47.5 MiB left after the weights, and the first step adds 64.0 MiB" in text
    assert ("No level this run may take fits (shard_optimizer=False, shard='optimizer'); the least, "
            "shard='optimizer', needs 1.5 MiB more on CPU:0, 16.5 MiB more on CPU:1.") in text
    assert text.endswith("Give those devices more memory, or train a smaller model.")
