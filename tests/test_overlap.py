"""Gradient sums started during the backward pass (multigpu.backend.torch.overlap), in one process.

A world of one gloo rank: each all-reduce returns its input, so what is checked is the plan (buckets,
their order, when they start) and what reaches the optimizer, not the transport.
"""

import os
import warnings
from contextlib import nullcontext

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import pytest
import torch
import torch.distributed as dist

from multigpu.backend.torch.overlap import FIRST_BUCKET_BYTES, Bucketed
from multigpu.backend.torch.reducer import GradientSync


class GroupComm:
    """The two hot-path calls of ``Comm`` over the process group (a world of one)."""

    world_size, rank, device, members, alone, among = 1, 0, torch.device("cpu"), [0], False, None

    def buffer(self, n, dtype=torch.float32):
        return torch.empty(n, dtype=dtype)

    def reduce(self, buf, *, tag=0, what="", describe=None):
        dist.all_reduce(buf)
        return buf

    def fatal(self, what):
        return nullcontext()


@pytest.fixture
def group(tmp_path):
    if dist.is_initialized():  # pragma: no cover - another test left a group
        pytest.fail("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def model():
    keras.utils.set_random_seed(3)
    m = keras.Sequential([keras.Input((400,)), keras.layers.Dense(1000), keras.layers.Dense(300),
                          keras.layers.Dense(4)])  # 1.6 MB, 1.2 MB and 4.8 KB of weights
    m.compile(optimizer="sgd", loss="mse")
    return m


def test_buckets_take_variables_last_first_and_a_large_one_alone():
    m = model()
    plan = Bucketed(m.trainable_variables, torch.float32, torch.device("cpu"), tail=8, bucket_bytes=1 << 20)
    sizes = [v.value.numel() for v in m.trainable_variables]  # 400000, 1000, 300000, 300, 1200, 4
    # last variables first, contiguous from offset 0
    assert plan.offsets[-1] == 0 and plan.offsets[-2] == 4 and plan.offsets[0] == sum(sizes) - sizes[0]
    # at 1 MiB a bucket: [4 + 1200 + 300 values], [the 1.2 MB kernel alone], [1000 values], [the 1.6 MB kernel]
    assert [n for *_, n in plan.buckets] == [3, 1, 1, 1]
    spans = [(a, b) for a, b, _ in plan.buckets]
    assert spans[0][0] == 0 and all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    assert spans[-1][1] == plan.numel == sum(sizes)
    assert (spans[0][1] - spans[0][0]) * 4 <= FIRST_BUCKET_BYTES
    assert sum(n for *_, n in plan.buckets) == len(sizes)


def step(sync, m, x, y, weight, change=None):
    sync.begin_step(weight)
    m.zero_grad()
    loss = torch.mean((m(x) - y) ** 2)
    loss.backward()
    started = sync._armed[1].launched if sync._armed is not None else 0
    grads = [v.value.grad for v in m.trainable_variables]
    if change is not None:
        change(grads)
    local = [None if g is None else g.clone() for g in grads]
    out = sync.reduce(grads, m.trainable_variables)
    sync.end_step()
    return out, local, started


def test_sums_start_during_backward_and_equal_the_plain_path(group):
    m = model()
    sync = GradientSync(GroupComm(), waiting=nullcontext, overlap=True)
    x, y = torch.randn(16, 400), torch.randn(16, 4)
    out, local, started = step(sync, m, x, y, 0.25)
    assert started == 0 and not sync.overlapping  # the first step learns the call's variables
    for _ in range(2):
        out, local, started = step(sync, m, x, y, 0.25)
        assert started >= 1 and sync.overlapping  # buckets were summing before optimizer.apply
        for g, o in zip(local, out):
            torch.testing.assert_close(o, g * 0.25, rtol=0, atol=0)


def test_gradients_changed_after_backward_are_summed_again_and_overlap_stops(group):
    m = model()
    sync = GradientSync(GroupComm(), waiting=nullcontext, overlap=True)
    x, y = torch.randn(16, 400), torch.randn(16, 4)
    step(sync, m, x, y, 0.5)

    def halve(grads):
        for g in grads:
            g.mul_(0.5)  # in place: the buckets already hold the values from before

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, local, _ = step(sync, m, x, y, 0.5, change=halve)
    for g, o in zip(local, out):
        torch.testing.assert_close(o, g * 0.5, rtol=0, atol=0)
    assert not sync.overlap and not sync.overlapping
    assert any("no longer starts the gradient sums" in str(w.message) for w in caught)
    out, local, started = step(sync, m, x, y, 0.5)
    assert started == 0


def test_a_variable_without_gradient_stays_none(group):
    m = model()
    sync = GradientSync(GroupComm(), waiting=nullcontext, overlap=True)
    x, y = torch.randn(8, 400), torch.randn(8, 4)
    first = m.trainable_variables[0]
    first.value.requires_grad_(False)
    try:
        for _ in range(2):
            out, _, _ = step(sync, m, x, y, 1.0)
        assert out[0] is None and all(o is not None for o in out[1:]) and sync.overlapping
    finally:
        first.value.requires_grad_(True)


def test_a_bad_bucket_size_is_refused_and_a_good_one_reaches_the_sums():
    from multigpu.arguments import bucket_mb as _bucket_mb
    from multigpu.arguments import megabytes as _megabytes
    from multigpu.backend.torch.step import _bucket_bytes

    with pytest.raises(ValueError, match=r"MULTIGPU_BUCKET_MB is a bucket size in MiB.*Received: 'lots'"):
        _megabytes("lots")
    with pytest.raises(ValueError, match=r"`bucket_mb` is a bucket size in MiB.*Received: bucket_mb=0"):
        _bucket_mb(0)
    assert GradientSync(GroupComm(), waiting=nullcontext, overlap=True,
                        bucket_bytes=_bucket_bytes(_bucket_mb(0.5))).bucket_bytes == 1 << 19


class _Device:
    def __init__(self, is_cuda):
        self.is_cuda = is_cuda


def test_overlap_is_chosen_per_transport_and_machine_unless_the_caller_chooses():
    from types import SimpleNamespace

    from multigpu.backend.torch.step import _overlap

    def comm(transport, same_host, cuda=False):
        runtime = SimpleNamespace(same_host=same_host, devices=[_Device(cuda), _Device(cuda)])
        return SimpleNamespace(world_size=2, transport=transport, runtime=runtime)

    assert not _overlap(comm("shm", True))
    assert not _overlap(comm("gloo", True))  # CPU ranks of one machine: gloo's threads take the cores
    assert _overlap(comm("gloo", False))  # between machines
    assert _overlap(comm("gloo", True, cuda=True))  # GPUs: NCCL beside the computing
    assert _overlap(comm("gloo", True), forced=True)  # parallelize(overlap=True)
    assert not _overlap(comm("gloo", False), forced=False)
