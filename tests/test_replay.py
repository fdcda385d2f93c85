"""The replayed forward pass (``multigpu.backend.torch.replay``): the same numbers as Keras's own, or Keras's own."""

import os

import keras
import numpy as np
import pytest
import torch

from multigpu.backend.torch import replay
from multigpu.backend.torch.replay import ForwardReplay

pytestmark = pytest.mark.skipif(os.environ.get("KERAS_BACKEND") != "torch", reason="the torch backend's step")


def _mlp(extra=()):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"), *extra,
                              keras.layers.Dense(4, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    return (torch.as_tensor(rng.normal(size=(rows, 12)).astype("float32")),
            torch.as_tensor(rng.integers(0, 4, size=(rows,))))


def _grads(model, fn, *args):
    model.zero_grad()
    y_pred, loss = fn(*args)[:2]
    loss.backward()
    return y_pred, loss, [v.value.grad.clone() for v in model.trainable_variables]


def _assert_same(a, b):
    for p, q in zip(keras.tree.flatten(a), keras.tree.flatten(b)):
        assert p.dtype == q.dtype and torch.equal(p.detach(), q.detach())


def test_replay_gives_keras_outputs_loss_and_gradients_bit_for_bit():
    model = _mlp()
    r = ForwardReplay(model)
    x, y = _data(8)
    for _ in range(2):  # the signature is recorded at its second step
        _, _, recorded = r(x, y, None)
    assert recorded and r.recorded == 1 and r.reason is None
    for seed in (1, 2):  # new data of the same signature: replayed
        x, y = _data(8, seed)
        got = _grads(model, r, x, y, None)
        want = _grads(model, r._keras, x, y, None)
        _assert_same(got[0], want[0])
        _assert_same(got[1], want[1])
        _assert_same(got[2], want[2])
    assert r.replayed == 2


def test_each_signature_is_recorded_once_at_its_second_step_and_at_most_max_graphs_kept():
    model = _mlp()
    r = ForwardReplay(model, max_graphs=2)
    for rows in (5, 5, 6, 6, 7, 7):
        r(*_data(rows), None)
        r._record_cost = 0.0  # recordings' costs forgotten: each signature is recorded at its second step
    assert r.recorded == 3 and len(r._graphs) == 2  # 5 rows' graph dropped
    x, y = _data(5)
    before = r.replayed
    r(x, y, None)
    assert r.replayed == before  # 5 rows: Keras's own pass again
    x, y = _data(7)
    _assert_same(r(x, y, None)[1], r._keras(x, y, None)[1])
    assert r.replayed == before + 1


def test_a_model_with_several_inputs_and_outputs_and_an_input_given_twice():
    keras.utils.set_random_seed(2)
    a = keras.Input((6,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2))(
        keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, {"out": keras.layers.Dense(6, name="out")(h),
                                           "cls": keras.layers.Dense(2, activation="softmax", name="cls")(h)})
    model.compile(optimizer="sgd", loss={"out": "mse", "cls": "sparse_categorical_crossentropy"},
                  loss_weights={"out": 0.5, "cls": 2.0})
    r = ForwardReplay(model)
    rng = np.random.default_rng(0)

    def batch():
        xa = torch.as_tensor(rng.normal(size=(4, 6)).astype("float32"))
        x = {"a": xa, "b": torch.as_tensor(rng.normal(size=(4, 3)).astype("float32"))}
        return x, {"out": xa, "cls": torch.as_tensor(rng.integers(0, 2, size=(4,)))}  # xa twice

    for _ in range(3):  # the loss's per-output trackers are built at the first step: recorded at the third
        r(*batch(), None)
    assert r.recorded == 1, r.reason
    x, y = batch()

    def tracked():  # the loss's per-output trackers (sums and counts)
        return [v.value.clone() for v in model.metrics_variables]

    t0 = tracked()
    got = _grads(model, r, x, y, None)
    t1 = tracked()
    for v, value in zip(model.metrics_variables, t0):
        v.assign(value)
    want = _grads(model, r._keras, x, y, None)
    assert r.replayed == 1 and set(got[0]) == {"out", "cls"}
    for g, w in zip(got, want):
        _assert_same(g, w)
    assert any(not torch.equal(a, b) for a, b in zip(t0, t1))  # the replay wrote the trackers...
    _assert_same(t1, tracked())  # ...as Keras's pass does
    assert all(v.value.grad_fn is None for v in model.metrics_variables)  # ...and with gradients off


def test_batchnorm_is_replayed_and_its_statistics_are_as_without_replay():
    def run(use_replay):
        model = _mlp([keras.layers.BatchNormalization()])
        r = ForwardReplay(model, enabled=use_replay)
        for seed in range(3):
            x, y = _data(8, seed)
            _grads(model, r, x, y, None)
        return r, [v.value for v in model.non_trainable_variables]

    r, stats = run(True)
    assert r.recorded == 1 and r.replayed == 1, r.reason  # recorded at step 2 (its writes undone), replayed at 3
    assert all(s.grad_fn is None for s in stats)
    _, plain = run(False)
    _assert_same(stats, plain)


@pytest.mark.parametrize("seed", [None, 3])
def test_dropout_draws_the_numbers_keras_would_replayed_or_not(seed):
    """An unseeded Dropout draws from torch's default generator: replayed, it draws the same numbers in the same
    order as Keras's pass.  A seeded one reads its seed into Python, so it is never recorded."""
    def run(use_replay):
        model = _mlp([keras.layers.Dropout(0.5, seed=seed)])
        r = ForwardReplay(model, enabled=use_replay)
        torch.manual_seed(3)
        outs = [r(*_data(8, step), None)[0] for step in range(4)]
        return r, outs, torch.random.get_rng_state(), [v.value.clone() for v in model.non_trainable_variables]

    r, outs, rng, seeds = run(True)
    if seed is None:
        assert r.recorded == 1 and r.replayed == 2 and r.reason is None
    else:
        assert r.recorded == 0 and r.reason.startswith("recording failed")
    _, plain_outs, plain_rng, plain_seeds = run(False)
    _assert_same(outs, plain_outs)
    _assert_same(seeds, plain_seeds)
    assert torch.equal(rng, plain_rng)


class _Branchy(keras.layers.Layer):
    def call(self, x):
        return x * 2.0 if float(keras.ops.sum(x)) > 0 else x


def test_own_layers_keep_keras_pass_and_a_branch_on_data_is_never_recorded(monkeypatch):
    model = _mlp([_Branchy(name="branchy")])
    r = ForwardReplay(model)
    r(*_data(8), None)
    assert "branchy" in r.reason
    monkeypatch.setattr(replay, "ineligible", lambda model: None)
    r = ForwardReplay(model)
    for _ in range(2):
        r(*_data(8), None)
    assert r.recorded == 0 and r.reason.startswith("recording failed")


def test_replay_can_be_turned_off():
    r = ForwardReplay(_mlp(), replay=False)  # parallelize(replay=False), or MULTIGPU_REPLAY=0 where it is unset
    for _ in range(3):
        r(*_data(8), None)
    assert r.recorded == 0 and r.reason == "replay=False"


def test_a_signature_is_recorded_once_its_steps_took_as_long_as_the_last_recording():
    r = ForwardReplay(_mlp())
    r(*_data(8), None)
    r._record_cost = 60.0  # as if the last recording had taken a minute
    for _ in range(3):
        r(*_data(8), None)
    assert r.recorded == 0
    r._record_cost = 0.0
    r(*_data(8), None)
    assert r.recorded == 1 and r._record_cost > 0


def test_while_the_share_search_moves_a_new_signature_is_recorded_at_its_first_step():
    r = ForwardReplay(_mlp())
    assert not r(*_data(8), None, prompt=True)[2]  # nothing recorded yet: the model's first steps run as Keras's
    r(*_data(8), None)
    assert r.recorded == 1
    r._record_cost = 0.5  # a recording costs less than replay.PROMPT_SECONDS
    assert not r(*_data(9), None)[2]  # the search is still: the seconds rule
    assert r(*_data(10), None, prompt=True)[2] and r.recorded == 2  # moving: at once
    assert not r(*_data(10), None, prompt=True)[2] and r.replayed == 1
    r._record_cost = 60.0  # a dear recording: the seconds rule even while the search moves
    assert not r(*_data(11), None, prompt=True)[2] and r.recorded == 2


def test_what_a_replay_saves_is_measured_and_decides_later_recordings():
    """The first signature's replays are timed against its passes through Keras; a later signature is recorded
    once its steps through Keras's pass would have saved a recording's cost, and never when a replay saves
    nothing (a model whose time is its arithmetic), even while the search moves."""
    r = ForwardReplay(_mlp(), record_at=1 + replay._WARM_PASSES)
    for _ in range(1 + replay._WARM_PASSES + replay._TIMED_REPLAYS):
        r(*_data(8), None)
    assert r.recorded == 1 and r.gain is not None and r.gain > 0  # an MLP: most of its pass is Keras's Python
    r.gain, r._record_cost = 0.0, 0.01  # a replay saves nothing
    for _ in range(50):
        assert not r(*_data(9), None, prompt=True)[2]
    assert r.recorded == 1
    r.gain, r._record_cost = 0.001, 0.0035  # 1 ms per step against a 3.5 ms recording: recorded at the 4th step
    assert [r(*_data(10), None)[2] for _ in range(4)] == [False, False, False, True]
    assert r.recorded == 2
    r.gain, r._record_cost = 1.0, 0.5  # a replay that saves, while the search moves: at once
    assert r(*_data(11), None, prompt=True)[2] and r.recorded == 3


def test_where_the_steps_left_in_fit_are_known_a_signature_is_recorded_at_once_or_not_in_this_fit():
    """Once the shares settled, the steps left in ``fit`` are known (``ahead``): a signature is recorded at its
    first step if they would save what a recording costs, and never in this fit if they would not (renting, a
    GRU paid a 2-4 s recording in its last epoch to save at most 0.1 s)."""
    r = ForwardReplay(_mlp(), record_at=1 + replay._WARM_PASSES)
    for _ in range(1 + replay._WARM_PASSES + replay._TIMED_REPLAYS):
        r(*_data(8), None)
    assert r.recorded == 1
    r.gain, r._record_cost = 0.001, 0.0035  # 1 ms saved a step, a 3.5 ms recording
    assert r(*_data(10), None, ahead=4)[2] and r.recorded == 2  # 4 steps left save 4 ms: bought at once
    assert [r(*_data(9), None, ahead=left)[2] for left in (5 - 2, 2, 1, 0, 0, 0)] == [False] * 6
    assert r.recorded == 2  # renting (ahead unknown) would have recorded it at its 4th step
    r.gain = None  # not measured: bounded by a free replay's saving, Keras's pass time a step
    r._record_cost = 3600.0
    assert not r(*_data(11), None, ahead=10)[2]
    r._record_cost = 0.0
    assert r(*_data(12), None, ahead=10)[2] and r.recorded == 3


def test_the_steps_ahead_are_known_only_once_the_shares_settled_at_a_whole_global_batch():
    """``StepsCore.steps_ahead``: None (the replay then rents) while the search moves, for a last partial batch,
    or where the steps of an epoch are not known; else the steps of ``fit`` left after this one."""
    from types import SimpleNamespace

    from multigpu.backend.steps import StepsCore

    steps = SimpleNamespace(balancer=SimpleNamespace(searching=False, batch_size=64),
                            parallel=SimpleNamespace(position={"epochs": 3, "epoch": 1, "step": 4}, steps_per_epoch=10))
    whole, partial = SimpleNamespace(total=64), SimpleNamespace(total=40)
    assert StepsCore.steps_ahead(steps, whole) == 2 * 10 - 4 - 1
    assert StepsCore.steps_ahead(steps, partial) is None
    steps.balancer.searching = True
    assert StepsCore.steps_ahead(steps, whole) is None
    steps.balancer.searching, steps.parallel.steps_per_epoch = False, None  # a generator of unknown length
    assert StepsCore.steps_ahead(steps, whole) is None


def test_a_keras_hub_backbone_with_dropout_is_replayed_bit_for_bit():
    """keras-hub's modeling layers (transformer blocks, attention, embeddings) are trusted like Keras's own."""
    pytest.importorskip("keras_hub", reason="needs keras-hub (make test installs it)")
    from multigpu.bench.models import get_model

    spec = get_model("bert")
    keras.utils.set_random_seed(5)
    model = spec.build(0.25)  # hidden 16, its BERT dropout 0.1 kept
    spec.compile(model)
    r = ForwardReplay(model)
    x, y = (torch.as_tensor(a) for a in spec.data(6, 0))
    for _ in range(2):
        r(x, y, None)
    assert r.recorded == 1 and r.reason is None
    x, y = (torch.as_tensor(a) for a in spec.data(6, 1))
    state = torch.random.get_rng_state()
    got = _grads(model, r, x, y, None)
    torch.random.set_rng_state(state)
    want = _grads(model, r._keras, x, y, None)
    assert r.replayed == 1
    for a, b in zip(got, want):
        _assert_same(a, b)


def test_the_checks_gradient_digests_tell_equal_gradients_from_any_other():
    from multigpu.backend.torch.digest import gradient_digests

    torch.manual_seed(0)
    w, b, unused = (torch.nn.Parameter(torch.randn(*s)) for s in ((3, 4), (4,), (2,)))
    x = torch.randn(5, 3)

    def loss(scale=1.0):
        return ((x @ w + b) ** 2).sum() * scale

    a = gradient_digests(loss(), [w, b, unused], retain_graph=True)
    assert a == gradient_digests(loss(), [w, b, unused])  # the same pass: the same bytes
    assert a[2] is None and a[0][:2] == (torch.float32, (3, 4))
    nudged = gradient_digests(loss(1.0 + 2**-20), [w, b, unused])  # gradients a few ulps away
    assert nudged[0] != a[0] and nudged[1] != a[1]
    want = torch.autograd.grad(loss(), [w])[0]  # and the parameters' own gradients are untouched
    assert w.grad is None and torch.isfinite(want).all()
