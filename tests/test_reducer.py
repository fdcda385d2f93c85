"""The gradient path in one process: ranks are threads, the collective a sum behind a barrier."""

import threading
from types import SimpleNamespace

import pytest
import torch

from multigpu._keras.ledger import Ledger
from multigpu.backend.torch.reducer import GradientSync


class ThreadComm:
    """``Comm``'s two hot-path calls for ranks that are threads of this process."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.shared = rank, shared
        self.world_size = shared["world"]
        self.members = list(range(self.world_size))  # the ranks in the group, as the engine's Comm says
        self.alone, self.among = False, None  # (no device set aside)

    def buffer(self, n, dtype=torch.float32):
        return torch.empty(n, dtype=dtype)

    def reduce(self, buf, *, tag=0, what="", describe=None):
        s = self.shared
        s["slots"][self.rank] = buf.clone()
        s["barrier"].wait()
        total = sum(s["slots"][r].to(torch.float64) for r in range(self.world_size)).to(buf.dtype)
        s["barrier"].wait()
        return total


def run_ranks(world: int, body):
    """Runs ``body(rank, GradientSync)`` on ``world`` threads; returns their results in rank order."""
    shared = {"world": world, "slots": {}, "barrier": threading.Barrier(world, timeout=20)}
    results, errors = [None] * world, []

    def target(rank):
        try:
            sync = GradientSync(ThreadComm(rank, shared), waiting=_Null)
            results[rank] = body(rank, sync)
        except BaseException as exc:
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def variable(tensor, path="v"):
    return SimpleNamespace(value=tensor, path=path, shape=tuple(tensor.shape))


def data(rows=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=g), torch.randn(rows, 2, generator=g)


@pytest.mark.parametrize("sizes", [(10, 3), (4, 4, 5), (13, 0), (1, 2, 10)])
def test_weighted_sum_equals_the_full_batch_gradient(sizes):
    x, y = data(sum(sizes))
    w0 = torch.randn(5, 2, generator=torch.Generator().manual_seed(1))
    full = w0.clone().requires_grad_()
    ((x @ full - y) ** 2).mean().backward()

    def body(rank, sync):
        begin = sum(sizes[:rank])
        w = w0.clone().requires_grad_()
        bias = torch.zeros(2, requires_grad=True)
        xs, ys = x[begin : begin + sizes[rank]], y[begin : begin + sizes[rank]]
        if len(xs):
            ((xs @ w + bias - ys) ** 2).mean().backward()
        sync.begin_step(len(xs) / sum(sizes))
        return sync.reduce([w.grad, bias.grad], [variable(w, "w"), variable(bias, "b")])

    results = run_ranks(len(sizes), body)
    for grads in results:
        torch.testing.assert_close(grads[0], full.grad, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(r[0], results[0][0]) for r in results)


def test_a_gradient_missing_everywhere_stays_none_and_missing_somewhere_counts_as_zero():
    def body(rank, sync):
        a, b, c = (torch.ones(3), torch.ones(2), torch.ones(1))
        grads = [torch.full((3,), 2.0), torch.full((2,), 1.0) if rank == 0 else None, None]
        sync.begin_step(0.5)
        return sync.reduce(grads, [variable(a), variable(b), variable(c)])

    for grads in run_ranks(2, body):
        torch.testing.assert_close(grads[0], torch.full((3,), 2.0))
        torch.testing.assert_close(grads[1], torch.full((2,), 0.5))
        assert grads[2] is None  # as on one device: the optimizer skips it (momentum too)


def test_extras_travel_with_the_gradients_in_the_same_collective():
    def body(rank, sync):
        sync.begin_step(0.5)
        sync.attach(torch.tensor([float(rank + 1), 10.0]))
        sync.reduce([torch.ones(4)], [variable(torch.zeros(4))])
        return sync.extras_out, sync.calls

    for extras, calls in run_ranks(2, body):
        assert extras == [3.0, 20.0] and calls == 1


def test_ranks_whose_optimizer_calls_differ_get_an_error_naming_what_they_summed(monkeypatch):
    import multigpu.failure

    def fail(reason):
        raise RuntimeError(reason)

    monkeypatch.setattr(multigpu.failure, "fail", fail)

    def body(rank, sync):
        sync.begin_step(0.5)
        names = ["dense/kernel", "dense/bias"] if rank == 0 else ["dense/kernel", "other/bias"]
        sync.reduce([torch.ones(2), torch.ones(2)], [variable(torch.zeros(2), n) for n in names])

    with pytest.raises(RuntimeError, match=r"optimizer calls did not match: this rank summed 2 gradients "
                                           r"\(4 values: dense/kernel, (dense|other)/bias\)"):
        run_ranks(2, body)


@pytest.mark.parametrize(("compression", "tolerance"), [("bf16", 1e-2), ("fp16", 2e-3)])
def test_compression_sends_16_bits_and_keeps_the_weighting_exact(compression, tolerance):
    g = torch.Generator().manual_seed(3)
    per_rank = [torch.randn(1000, generator=g) for _ in range(2)]
    weights = [0.75, 0.25]

    def body(rank, sync):
        sync.compression = compression
        sync.begin_step(weights[rank])
        return sync.reduce([per_rank[rank].clone()], [variable(torch.zeros(1000))])[0]

    got = run_ranks(2, body)[0]
    exact = 0.75 * per_rank[0] + 0.25 * per_rank[1]
    assert got.dtype == torch.float32
    assert float((got - exact).abs().max() / exact.abs().max()) < tolerance


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_gradients_are_the_same_numbers_as_one_mixed_dtype_multiply(compression):
    """Cast a chunk at a time through float32 (fast on a CPU), read back into one kept buffer."""
    from multigpu.backend.torch import flat, reducer

    half = reducer.COMPRESSION[compression]
    grads = [torch.randn(2 * flat.CAST_CHUNK + 123, generator=torch.Generator().manual_seed(5)), torch.randn(7)]

    def body(rank, sync):
        sync.compression = compression
        sync.begin_step(0.3)
        return sync.reduce([g.clone() for g in grads], [variable(torch.zeros(g.shape)) for g in grads])

    got = run_ranks(1, body)[0]
    for g, out in zip(grads, got):
        want = torch.mul(g, 0.3, out=torch.empty(g.shape, dtype=half)).float()
        assert out.dtype == torch.float32 and torch.equal(out, want)


def test_unknown_compression_is_refused():
    with pytest.raises(ValueError, match=r"`compression` must be one of .*Received: compression='zip'"):
        GradientSync(None, waiting=_Null, compression="zip")


def test_wrapped_optimizer_sums_before_applying_and_only_inside_a_step():
    import keras

    shared = {"world": 1, "slots": {}, "barrier": threading.Barrier(1)}
    sync = GradientSync(ThreadComm(0, shared), waiting=_Null)
    v = keras.Variable([1.0, 1.0])
    opt = keras.optimizers.SGD(learning_rate=1.0)
    ledger = Ledger()
    sync.wrap(opt, ledger)
    sync.wrap(opt, ledger)  # twice: still one wrapper
    opt.apply([torch.tensor([1.0, 1.0])], [v])  # outside a step: plain Keras
    assert sync.calls == 0
    sync.begin_step(0.5)
    opt.apply([torch.tensor([1.0, 1.0])], [v])
    assert sync.calls == 1 and len(sync.log) == 1
    torch.testing.assert_close(v.value, torch.tensor([-0.5, -0.5]))  # 1 - 1 - 0.5 * 1
    ledger.undo()
    assert "apply" not in vars(opt) and opt.apply.__func__ is type(opt).apply
