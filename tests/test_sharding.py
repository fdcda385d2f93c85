"""A sharded optimizer (``parallelize(..., shard_optimizer=True)``): exact against one device, on torch and TensorFlow.

The partition (:mod:`multigpu.planning.partition`) is tested in-process; the
runs (``tests/scripts/sharded.py``) compare 2 devices at 3:1 and 3 devices at
1:2:5 with one plain process: every optimizer feature, a ``train_step`` of
the model's own, a GAN with two optimizers, the whole state after
``unparallelize``, and a checkpoint written by a sharded run that a plain
process loads and trains on.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from multigpu.planning.partition import memory_weights, owners, parts
from tests.conftest import SCRIPTS, run_together

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_owners_follow_the_weights_within_one_variable():
    sizes = [1000, 10, 500, 500, 250, 250, 7, 3]
    for weights in ([1, 1], [3, 1], [1, 2, 5], [2, 2, 2, 2]):
        owner = owners(sizes, weights)
        assert owners(sizes, weights) == owner  # the same on every rank
        got = parts(sizes, owner, len(weights))
        assert sum(got) == sum(sizes)
        for part, w in zip(got, weights):
            assert abs(part - sum(sizes) * w / sum(weights)) <= max(sizes)
    assert parts(sizes, owners(sizes, [3, 1]), 2)[0] > parts(sizes, owners(sizes, [1, 3]), 2)[0]
    assert memory_weights([2 << 30, 1 << 30]) == [2.0 * (1 << 30), 1.0 * (1 << 30)]
    assert memory_weights([2 << 30, None]) == [1.0, 1.0]
    # a rank at 0 (a device set aside) owns nothing; the others share every variable
    assert set(owners(sizes, [1, 0, 2])) == {0, 2}
    assert parts(sizes, owners(sizes, [0, 1]), 2) == [0, sum(sizes)]
    for weights in ([0, 0], [1, -1], []):
        with pytest.raises(ValueError, match="one above 0"):
            owners([1, 2], weights)


def test_shard_optimizer_is_refused_with_min_devices_and_where_it_is_not_built(monkeypatch):
    import keras

    import multigpu
    from multigpu import arguments, backend

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"cannot go with `min_devices`.*min_devices=1"):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard_optimizer=True, min_devices=1)
    with pytest.raises(TypeError, match=r"must be True, False or None. Received: shard_optimizer='yes'"):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard_optimizer="yes")
    with pytest.raises(ValueError, match=r"`shard` must be one of 'optimizer', 'gradients', 'weights' or None. "
                                         r"Received: shard='all'"):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard="all")
    with pytest.raises(ValueError, match=r"give one of them. Received: shard='gradients', shard_optimizer=False"):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard="gradients", shard_optimizer=False)
    with pytest.raises(ValueError, match=r"cannot go with `min_devices`.*shard='weights'"):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard="weights", min_devices=1)
    with pytest.raises(ValueError, match=r"does not allow .*Received: shard='weights', overlap=True\. "):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard="weights", overlap=True)
    with pytest.raises(ValueError, match=r"cannot go with `min_devices`"):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard="gradients", min_devices=1)
    for given, pattern in (({"compression": "bf16"}, "compression='bf16'"),
                           ({"sync_batchnorm": True}, "sync_batchnorm=True"), ({"overlap": True}, "overlap=True")):
        with pytest.raises(ValueError, match=rf"does not allow .*Received: shard='gradients', {pattern}\. "
                                             r"Use shard='optimizer'"):
            multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard="gradients", **given)
    # by default the gradients are in parts only where the step writes them during the backward pass
    torch_facts = backend.facts()
    assert arguments.shard_by_default("shm", False, torch_facts) == ("gradients" if torch_facts.shard_gradients
                                                                     else "optimizer")
    assert arguments.shard_by_default("shm", False, torch_facts, streams=False) == "optimizer"
    assert arguments.shard_by_default("gloo", False, torch_facts) is False
    facts = backend.facts()
    monkeypatch.setattr(backend, "facts", lambda: type(facts)("numpy"))
    with pytest.raises(ValueError, match=r"runs on the torch, TensorFlow and JAX backends.*KERAS_BACKEND=numpy"):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard_optimizer=True)
    monkeypatch.setattr(backend, "facts", lambda: type(facts)("tensorflow", shard_optimizer=True))
    with pytest.raises(ValueError, match=r"`shard='gradients'` runs on the torch backend; on the tensorflow backend "
                                         r"use shard='optimizer'"):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard="gradients")
    with pytest.raises(ValueError, match=r"`shard='weights'` .*runs on the torch backend; on the tensorflow backend "
                                         r"use shard='optimizer'. Received: shard='weights' with KERAS_BACKEND="):
        multigpu.parallelize(model, devices=["cpu:0", "cpu:1"], shard="weights")


def _run(args, cwd, timeout=240, extra=None):
    res = subprocess.run(args, capture_output=True, check=False, text=True, timeout=timeout,
                         env={**os.environ, **ENV, **(extra or {})}, cwd=cwd)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def _load(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12))


PLAIN_MODES = "default,features,custom,gan"


class _PlainRuns:
    """One plain process's results of every mode but the checkpoint (which reads the parallel run's file), per
    backend: run beside the first parallel run of the backend, or alone where asked for before."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.folders: dict = {}

    def pending(self, backend: str):
        """``(command, folder)`` of the backend's plain run not run yet, or None."""
        if backend in self.folders:
            return None
        folder = self.factory.mktemp(f"sharded-plain-{backend}")
        modes = PLAIN_MODES.replace(",gan", "") if backend == "jax" else PLAIN_MODES
        return [sys.executable, str(SCRIPTS / "sharded.py"), modes, str(folder / "plain"), "--plain"], folder

    def ran(self, backend: str, folder) -> None:
        self.folders[backend] = folder

    def __call__(self, backend: str):
        if backend not in self.folders:
            command, folder = self.pending(backend)
            _run(command, folder, extra={"KERAS_BACKEND": backend})
            self.ran(backend, folder)
        return self.folders[backend]


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    return _PlainRuns(tmp_path_factory)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("backend", "devices", "ratios", "transport", "shard"),
                         [("torch", "cpu:0,cpu:1", "3,1", "auto", "weights"),
                          ("torch", "cpu:0,cpu:1", "3,1", "auto", "gradients"),
                          ("torch", "cpu:0,cpu:1,cpu:2", "1,2,5", "gloo", "weights"),
                          ("torch", "cpu:0,cpu:1,cpu:2", "1,2,5", "gloo", "gradients"),
                          ("tensorflow", "cpu:0,cpu:1", "3,1", "auto", "optimizer"),
                          ("tensorflow", "cpu:0,cpu:1,cpu:2", "1,2,5", "gloo", "optimizer"),
                          ("jax", "cpu:0,cpu:1", "3,1", "auto", "optimizer"),
                          ("jax", "cpu:0,cpu:1,cpu:2", "1,2,5", "gloo", "optimizer")])
def test_a_sharded_optimizer_matches_one_device(tmp_path, plain_folder, backend, devices, ratios, transport, shard):
    """On torch with ``shard="weights"`` (each device holding only its part of the trainable weights while
    ``fit`` runs, a layer's gathered for its passes; the EMA refused) and ``shard="gradients"`` (the optimizer
    state in parts, and the built-in step's gradients written into the sum's buffer during the backward pass,
    none kept), elsewhere ``shard="optimizer"``.
    Over shared memory the new weights are written straight into the result (torch) or summed (TensorFlow,
    inside its step); over gloo (between machines, and a GPU beside a CPU) they are summed with zeros where a
    rank does not own.  On JAX (XLA's collectives) the new weights are summed after the compiled update; an
    optimizer with an EMA is refused there, and a GAN's second optimizer has no place in Keras's JAX state."""
    modes = f"{PLAIN_MODES},checkpoint" if transport == "auto" else "features,custom,gan"
    if backend == "jax":
        modes = modes.replace(",gan", "")
    n = len(devices.split(","))
    extra = {"MULTIGPU_TRANSPORT": transport, "KERAS_BACKEND": backend}
    # the parallel run first: the plain checkpoint run then loads its file
    parallel = [sys.executable, "-m", "multigpu", "run", "--devices", devices, str(SCRIPTS / "sharded.py"), modes,
                str(tmp_path / "par"), "--devices", devices, "--ratios", ratios, "--shard", shard]
    pending = plain_folder.pending(backend)  # one device's run of the modes beside it, the first time
    env = {**os.environ, **ENV, **extra}
    done = run_together({"args": parallel, "env": env, "cwd": tmp_path},
                        *([{"args": pending[0], "env": env, "cwd": pending[1]}] if pending else []), timeout=240)
    for res in done:
        assert res.returncode == 0, res.stdout[-3000:]
    if pending:
        plain_folder.ran(backend, pending[1])
    if "checkpoint" in modes:
        _run([sys.executable, str(SCRIPTS / "sharded.py"), "checkpoint", str(tmp_path / "plain"), "--plain"],
             tmp_path, extra=extra)

    def pair(mode):
        ranks = [_load(tmp_path / f"par-{mode}.npz")]
        ranks += [_load(tmp_path / f"par-{mode}.npz.rank{r}.npz") for r in range(1, n)]
        return _load((tmp_path if mode == "checkpoint" else plain_folder(backend)) / f"plain-{mode}.npz"), ranks

    if "default" in modes:
        plain, ranks = pair("default")  # by default: in parts where the sums run through shared memory
        on = backend != "jax"
        assert all(bool(r["sharded"]) == on for r in ranks), [bool(r["sharded"]) for r in ranks]
        # and the gradients too where the backend streams them (torch): none kept after the steps
        level = {"torch": "gradients", "tensorflow": "optimizer"}.get(backend, "None")
        assert [str(r["level"]) for r in ranks] == [level] * n
        assert all((int(r["gradients_kept"]) == 0) == (backend == "torch") for r in ranks)
        held = [int(r["held"]) for r in ranks]
        assert (max(held) < int(plain["held"])) == on, held
        # SGD keeps no state: whole by default where parts would hold only the optimizer state (the torch
        # gradients' level holds the gradients in parts too, and stays), and one device's weights either way
        sgd = {"torch": "gradients"}.get(backend, "None")
        assert [str(r["sgd_level"]) for r in ranks] == [sgd] * n
        assert rel(plain["sgd_weights"], ranks[0]["sgd_weights"]) < 1e-5

    plain, ranks = pair("features")
    names = [k.split(".")[0] for k in plain if k.endswith(".weights")]
    assert len(names) == 11
    if backend == "jax" or shard == "weights":
        assert all("cannot take an optimizer with `use_ema=True`" in str(r["ema.refused"]) for r in ranks)
        names.remove("ema")
    for name in names:
        tolerance = {"mixed_float16": 1e-3, "mixed_bfloat16": 1e-2}.get(name, 1e-4)
        r0 = ranks[0]
        assert rel(plain[f"{name}.weights"], r0[f"{name}.weights"]) < tolerance, name
        np.testing.assert_allclose(r0[f"{name}.loss"], plain[f"{name}.loss"], rtol=tolerance, err_msg=name)
        # the whole optimizer state, gathered by unparallelize, is one device's
        assert rel(plain[f"{name}.state"], r0[f"{name}.state"]) < tolerance, name
        assert str(r0[f"{name}.optimizer"]) == str(plain[f"{name}.optimizer"]), name
        for other in ranks[1:]:
            np.testing.assert_array_equal(r0[f"{name}.weights"], other[f"{name}.weights"], err_msg=name)
            np.testing.assert_array_equal(r0[f"{name}.state"], other[f"{name}.state"], err_msg=name)
        held = [int(r[f"{name}.held"]) for r in ranks]
        assert max(held) < int(plain[f"{name}.held"]), (name, held)  # no rank held the whole state
        assert sum(held) >= int(plain[f"{name}.held"]), (name, held)  # every part on some rank
        if shard in ("gradients", "weights"):  # the built-in step's gradients went into the sum's buffer
            assert int(plain[f"{name}.gradients_kept"]) > 0, name  # (one device keeps its last ones)
            assert [int(r[f"{name}.gradients_kept"]) for r in ranks] == [0] * n, name
    assert "LossScaleOptimizer" in str(ranks[0]["mixed_float16.optimizer"])

    for mode in ("custom", "gan") if backend != "jax" else ("custom",):
        plain, ranks = pair(mode)
        assert rel(plain["weights"], ranks[0]["weights"]) < 1e-4, mode  # Adam
        for other in ranks[1:]:
            np.testing.assert_array_equal(ranks[0]["weights"], other["weights"])
        assert max(int(r["held"]) for r in ranks) < int(plain["held"]), mode

    if "checkpoint" not in modes:
        return
    plain, ranks = pair("checkpoint")
    # a plain process that loads the sharded run's .keras file after epoch 1 and trains epoch 2 is a 2-epoch run
    assert rel(plain["weights"], plain["resumed"]) < 1e-4
    assert rel(plain["state"], plain["resumed_state"]) < 1e-4
    # and so is the sharded run that loads the ModelCheckpoint's .weights.h5 into its parts and trains epoch 2
    assert rel(plain["weights"], ranks[0]["loaded"]) < 1e-4
    for other in ranks[1:]:
        np.testing.assert_array_equal(ranks[0]["loaded"], other["loaded"])
