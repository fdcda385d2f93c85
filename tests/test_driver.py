"""The step driver (one retry loop for every backend) and the step message, in-process."""

from types import SimpleNamespace

import numpy as np
import pytest

from multigpu.backend.driver import StepDriver
from multigpu.backend.message import StepMessage
from multigpu.balancing.caps import OutOfMemoryStepError, is_out_of_memory
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
        self.balancer = SimpleNamespace(planner=SimpleNamespace(take=lambda rows: plan), lost=[], calibrated=True)
        self.recovery = SimpleNamespace(keep=lambda also=False: self.calls.append(("keep", also)) or "kept",
                                        welcome_due=False, after_loss=self._after_loss)
        self.memory = SimpleNamespace(bounded=True, cut_again=self._cut_again)

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
    logs = StepDriver(steps, batch=lambda data: f"tensors of {data}").train("batch", 8, steps.attempt)
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
        StepDriver(failing).train("batch", 8, failing.attempt)
    assert [c[0] for c in failing.calls] == ["keep", "attempt"]
