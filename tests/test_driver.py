"""The step driver (one retry loop for every backend) and the step message, in-process."""

from types import SimpleNamespace

import numpy as np
import pytest

from multigpu.backend.driver import StepDriver
from multigpu.backend.message import StepMessage
from multigpu.balancing.caps import OutOfMemoryStepError, is_out_of_memory
from multigpu.balancing.parking import Parking
from multigpu.balancing.timing import StepTiming
from multigpu.membership import PeerLostError


def test_each_ranks_message_sums_to_one_every_rank_reads_by_section():
    message = StepMessage(timing=4, ranks=2)
    assert message.sections == {"timing": (0, 4), "waiting": (4, 1), "short": (5, 2), "cap": (7, 2)}
    rank0 = message.pack(0, [1.0, 0.0, 2.0, 0.0], waiting=True, short=0, cap=300)
    rank1 = message.pack(1, [0.0, 3.0, 0.0, 4.0], waiting=False, short=128, cap=0)
    read = message.read(np.add(rank0, rank1))
    assert read.timing == [1.0, 3.0, 2.0, 4.0]
    assert read.waiting and read.short == [0, 128] and read.cap == [300, 0]
    assert not message.read(np.add(message.pack(0, [0.0] * 4), message.pack(1, [0.0] * 4))).waiting


def test_a_message_of_another_length_is_refused_saying_what_was_received():
    message = StepMessage(timing=4, ranks=2)
    with pytest.raises(ValueError, match="4 slots; received 3"):
        message.pack(0, [0.0] * 3)
    with pytest.raises(ValueError, match="9 values; received 8"):
        message.read([0.0] * 8)


@pytest.mark.parametrize("error, expected", [
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("OOM when allocating tensor with shape[256,8192] and type float by allocator mklcpu"), True),
    (RuntimeError("Operation received an exception:Status: 1, message: could not execute a primitive"), True),
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes"), True),
    (RuntimeError("Operation received an exception:Status: 2, message: could not execute a primitive"), False),
    (ValueError("shapes (3,) and (4,) not aligned"), False),
])
def test_every_backends_out_of_memory_error_is_told_apart_from_others(error, expected):
    assert is_out_of_memory(error) is expected


class _Steps:
    """A backend's steps as the driver sees them, recording what it is asked."""

    def __init__(self, failures):
        self.failures = list(failures)
        self.calls = []
        plan = SimpleNamespace(sizes=[6, 2], local=6, total=8)
        self.balancer = SimpleNamespace(planner=SimpleNamespace(take=lambda rows: plan), lost=[], calibrated=True,
                                        parking=Parking([], print))  # (no device set aside)
        self.recovery = SimpleNamespace(keep=lambda also=False: self.calls.append(("keep", also)) or "kept",
                                        welcome_due=False, after_loss=self._after_loss)
        self.memory = SimpleNamespace(bounded=True, cut_again=self._cut_again)
        self.timing = SimpleNamespace(size=4)
        self.comm = SimpleNamespace(world_size=2, rank=0, alone=False, among=None)

    def lost_peer(self, exc):
        return exc if isinstance(exc, PeerLostError) else None

    def restore_forward(self, kept):
        self.calls.append(("restore_forward", kept))

    def restore_metrics(self):
        self.calls.append(("restore_metrics",))

    def _cut_again(self, short, plan):
        self.calls.append(("cut_again", short.rows))
        return "fewer rows", SimpleNamespace(sizes=[4, 4], local=4, total=8)

    def _after_loss(self, lost, kept, for_step):
        self.calls.append(("after_loss", kept, for_step))
        return "rows of the ranks left", SimpleNamespace(sizes=[8, 0], local=8, total=8), None

    def attempt(self, data, plan):
        self.calls.append(("attempt", data, list(plan.sizes)))
        if self.failures:
            raise self.failures.pop(0)
        return {"loss": 1.0}


def test_a_step_is_taken_again_after_running_out_of_memory_and_after_a_lost_peer_and_other_errors_pass():
    steps = _Steps([OutOfMemoryStepError([6, 0]), PeerLostError.__new__(PeerLostError)])
    logs = StepDriver(steps, batch=lambda data: f"tensors of {data}").train("batch", steps.attempt, rows=8)
    assert logs == {"loss": 1.0}
    assert steps.calls == [
        ("keep", True), ("attempt", "batch", [6, 2]),
        ("restore_forward", "kept"), ("restore_metrics",), ("cut_again", [6, 0]),
        ("keep", True), ("attempt", "tensors of fewer rows", [4, 4]),
        ("after_loss", "kept", True),
        ("keep", True), ("attempt", "tensors of rows of the ranks left", [8, 0]),
    ]
    failing = _Steps([ValueError("a bug in the model")])
    with pytest.raises(ValueError, match="a bug in the model"):
        StepDriver(failing).train("batch", failing.attempt, rows=8)
    assert [c[0] for c in failing.calls] == ["keep", "attempt"]


class _Rank:
    """One rank's steps as the driver's message and memory path sees them (real timing, a recording memory)."""

    def __init__(self, rank: int):
        self.timing = StepTiming(rank, 2)
        self.comm = SimpleNamespace(world_size=2, rank=rank, members=[0, 1], alone=False, among=None)
        self.said = []
        self.memory = SimpleNamespace(begin=lambda rows: self.said.append(("begin", rows)),
                                      end=lambda rows: 96 if rows == 64 else 0,
                                      release=lambda: self.said.append(("release",)),
                                      read=lambda short, cap: self.said.append(("read", short, cap)),
                                      fitted=lambda sizes: self.said.append(("fitted", list(sizes))))
        self.recovery = SimpleNamespace(waiting=lambda: False, elastic=True,
                                        read=lambda summed, offset, waiting: self.said.append(("noted", offset)))
        self.balancer = SimpleNamespace(record=lambda rec: self.said.append(("record", rec.samples)))


def test_a_pass_that_runs_out_of_memory_leaves_its_word_in_the_message_every_rank_reads():
    ranks = [_Rank(0), _Rank(1)]
    drivers = [StepDriver(r) for r in ranks]
    for r, rows in zip(ranks, (64, 32)):
        r.timing.begin()
        r.timing.end(rows)  # a finished step's timings, in this rank's slots
    fits = drivers[0].local(64, lambda: "gradients", lambda: ranks[0].said.append(("released",)))

    def runs_out():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    short = drivers[1].local(32, runs_out, lambda: ranks[1].said.append(("released",)))
    assert fits == ("gradients", 0, 96) and short == (None, 32, 0)
    assert ranks[1].said == [("begin", 32), ("released",)]
    summed = np.add(drivers[0].say(*fits[1:]), drivers[1].say(*short[1:]))
    for driver, r in zip(drivers, ranks):
        said = driver.heard(summed)
        assert (said.short, said.cap) == ([0, 32], [96, 0]) and r.said[-1] == ("read", [0, 32], [96, 0])
        driver.finish(summed, list(summed), 0)
        assert r.said[-2:] == [("noted", 0), ("record", (64, 32))]
    with pytest.raises(ValueError, match="not a memory error"):
        drivers[0].local(8, lambda: (_ for _ in ()).throw(ValueError("not a memory error")), lambda: None)
    with pytest.raises(RuntimeError, match="out of memory"):
        drivers[0].local(8, runs_out, lambda: None, may_retry=False)


def test_tensorflows_gpu_probe_reads_the_allocators_statistics_against_its_limit(monkeypatch):
    import multigpu.backend.tensorflow.memory as tf_memory

    stats = {"current": 3 << 20, "peak": 3 << 20}
    resets = []

    def reset(name):
        resets.append(name)
        stats["peak"] = stats["current"]

    probe = tf_memory.GpuMemory("GPU:0", limit=64 << 20, info=lambda name: dict(stats), reset=reset)
    assert probe.start() == (3 << 20, 61 << 20) and resets == ["GPU:0"]
    stats["peak"] = 40 << 20  # the step's activations
    assert probe.peak() == 40 << 20
    # the limit is TensorFlow's device list's: a device it does not list is not measured
    assert tf_memory.allocator_limit("CPU:0") > 0 and tf_memory.allocator_limit("GPU:7") is None
    monkeypatch.setattr(tf_memory, "allocator_limit", lambda name: None)
    assert tf_memory.GpuMemory("GPU:0", info=lambda name: dict(stats), reset=reset).start() is None
