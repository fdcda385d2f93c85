"""The exchange behind global BatchNorm statistics on JAX, in one process (a dict stands for the key-value store).

The real store, the compiled step and exactness against one device are tested on
real processes in ``tests/test_jax.py``.
"""

import threading

import numpy as np
import pytest

pytest.importorskip("jax", reason="the JAX backend's tests need jax (make test installs it)")

from multigpu.backend.jax.batchnorm import PREFIX, StatisticsExchange


class Store:
    """The three calls of jax.distributed's client that the exchange makes, over a dict."""

    def __init__(self):
        self.data, self.cond = {}, threading.Condition()

    def key_value_set_bytes(self, key, value):
        with self.cond:
            assert key not in self.data, f"{key} set twice"
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout=timeout_ms / 1000):
                raise TimeoutError(key)
            return self.data[key]

    def key_value_delete(self, prefix):
        with self.cond:
            for key in [k for k in self.data if k == prefix or k.startswith(prefix + "/")]:
                del self.data[key]


def _together(calls):
    """Runs one call per rank at once; their results in rank order."""
    out = [None] * len(calls)

    def run(r):
        out[r] = calls[r]()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def _ranks(weights, store=None):
    store = store or Store()
    ranks = [StatisticsExchange(store, r, len(weights), timeout=5) for r in range(len(weights))]
    for ex, w in zip(ranks, weights):
        ex.begin_step(w, w > 0)
    return store, ranks


def test_forward_sums_every_rank_bit_for_bit_alike_and_an_empty_rank_sends_zeros():
    _, ranks = _ranks([0.75, 0.25, 0.0])
    vectors = [np.array([1.0, 2.0], np.float32), np.array([0.1, 0.2], np.float32), np.array([9.0, 9.0], np.float32)]
    out = _together([lambda r=r: ranks[r].forward("0", vectors[r]) for r in range(3)])
    np.testing.assert_allclose(out[0], [1.1, 2.2], rtol=1e-6)  # the idle rank's 9s are not in the sum
    assert all(np.array_equal(out[0], o) for o in out)


def test_backward_hands_each_rank_the_share_weighted_sum_over_its_own_weight():
    """After the step multiplies rank r's gradient by w_r, the ranks' parts add up to sum_q w_q g_q."""
    weights = [0.75, 0.25, 0.0]
    _, ranks = _ranks(weights)
    g = [np.array([4.0, -2.0], np.float32), np.array([8.0, 6.0], np.float32), np.array([5.0, 5.0], np.float32)]
    out = _together([lambda r=r: ranks[r].backward("0", g[r]) for r in range(3)])
    want = 0.75 * g[0] + 0.25 * g[1]
    np.testing.assert_allclose(out[0] * 0.75, want, rtol=1e-6)
    np.testing.assert_allclose(out[1] * 0.25, want, rtol=1e-6)
    np.testing.assert_array_equal(out[2], np.zeros(2, np.float32))  # no rows: no gradient


def test_calls_pair_by_layer_direction_and_count_and_end_step_deletes_only_this_ranks_keys():
    store, ranks = _ranks([0.5, 0.5])
    one = np.ones(3, np.float32)

    def step(ex, scale):  # a layer called twice, another once, then the backward pass
        return [ex.forward("a", one * scale), ex.forward("b", 2 * one), ex.forward("a", 10 * one),
                ex.backward("b", one), ex.backward("a", one)]

    out = _together([lambda: step(ranks[0], 1.0), lambda: step(ranks[1], 3.0)])
    np.testing.assert_array_equal(out[0][0], 4 * one)  # "a", first call: 1 + 3
    np.testing.assert_array_equal(out[0][1], 4 * one)
    np.testing.assert_array_equal(out[0][2], 20 * one)  # "a", second call
    np.testing.assert_array_equal(out[0][3], 2 * one)  # (0.5 * 1 + 0.5 * 1) / 0.5
    assert all(np.array_equal(a, b) for a, b in zip(out[0], out[1]))
    assert ranks[0].exchanges == 5
    ranks[0].end_step()
    assert store.data and all(k.startswith(f"{PREFIX}/1/") for k in store.data)
    ranks[1].end_step()
    assert store.data == {}


def test_alone_uses_this_ranks_own_statistics_without_the_store():
    store, ranks = _ranks([0.5, 0.5])
    v = np.array([3.0], np.float32)
    with ranks[0].alone():
        np.testing.assert_array_equal(ranks[0].forward("0", v), v)
        np.testing.assert_array_equal(ranks[0].backward("0", v), v)
    assert store.data == {} and ranks[0].exchanges == 0
    assert not ranks[0].solo


def test_a_rank_that_never_comes_times_out():
    _, ranks = _ranks([0.5, 0.5])
    ranks[0].timeout_ms = 200
    with pytest.raises(TimeoutError):
        ranks[0].forward("0", np.ones(1, np.float32))
