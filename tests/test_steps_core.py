"""The backend-neutral part of the steps (multigpu.backend.steps), in one process with a recording backend."""

import os
from types import SimpleNamespace

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras

from multigpu.backend.steps import SEED_STRIDE, StepsCore
from multigpu.balancing.parking import Parking
from multigpu.devices import Device


class Recorded(StepsCore):
    def __init__(self, parallel) -> None:
        super().__init__(parallel)
        self.sent: list[tuple[str, list]] = []
        self.sources: list[int | None] = []  # the rank each broadcast is from (None: the leader)
        self.offsets: list[tuple[list, int]] = []

    def _broadcast_variables(self, variables, what, src=None):
        self.sent.append((what, list(variables)))
        self.sources.append(src)

    def _offset_seeds(self, variables, offset):
        self.offsets.append((list(variables), offset))


class _Runtime:
    def __init__(self, devices):
        self.devices = devices


class _Comm:
    def __init__(self, rank, devices):
        self.rank = rank
        self.runtime = _Runtime(devices)
        self.rejoined = False


class _Parallel:
    def __init__(self, model, rank, devices):
        self.model, self.comm = model, _Comm(rank, devices)
        self.timing = None
        self.balancer = SimpleNamespace(parking=Parking([], print), options=SimpleNamespace(auto=False))
        self.steps_per_epoch = None


def compiled_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dropout(0.5, seed=1)])
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse", metrics=["mae"])
    model.optimizer.build(model.trainable_variables)
    return model


def test_first_use_sends_rank_0s_weights_without_metric_states_and_offsets_seeds_by_rank_once():
    model = compiled_model()
    model.evaluate(keras.ops.ones((2, 3)), keras.ops.ones((2, 2)), verbose=0)  # builds the metric states
    steps = Recorded(_Parallel(model, 2, [Device("cpu", 0), Device("cpu", 1), Device("cpu", 2)]))
    steps._initialize()
    steps._initialize()
    assert len(steps.sent) == 1
    what, sent = steps.sent[0]
    assert what == "broadcasting the initial weights"
    metric_ids = {id(v) for m in model.metrics for v in m.variables}
    assert metric_ids and not metric_ids & {id(v) for v in sent}
    assert {id(v) for v in model.trainable_variables} <= {id(v) for v in sent}
    assert steps.offsets and steps.offsets[0][1] == 2 * SEED_STRIDE


def test_replicas_are_realigned_with_optimizer_state_only_across_kinds_of_processor():
    model = compiled_model()
    same = Recorded(_Parallel(model, 0, [Device("cpu", 0), Device("cpu", 1)]))
    same.realign_replicas()
    assert same.sent == []  # one kind of processor: bit-identical updates, nothing to send
    mixed = Recorded(_Parallel(model, 0, [Device("cuda", 0), Device("cpu", 0)]))
    mixed.realign_replicas()
    (what, sent), = mixed.sent
    assert what == "realigning the replicas"
    ids = [id(v) for v in sent]
    assert len(ids) == len(set(ids))
    assert {id(v) for v in model.optimizer.variables} <= set(ids)
    assert {id(v) for v in model.variables} <= set(ids)
    assert mixed.sources == [None]  # rank 0's copy
    mixed.balancer.parking.parked, mixed.balancer.parking.kept = [0], 1  # rank 0 set aside: rank 1 trained alone
    mixed.realign_replicas()
    assert mixed.sources == [None, 1]
