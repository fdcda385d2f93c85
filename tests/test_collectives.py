"""Every backend's ``Comm`` against the protocols of ``multigpu/backend/collectives.py``: the same members with the
same signatures (parameter names, kinds and defaults), and the same results on a real two-rank run of each backend.
"""

import inspect
import json
import os
import platform
import sys
from typing import Protocol

import pytest

from multigpu.backend.collectives import ElasticGroup, Group, HostVectors
from tests.conftest import SCRIPTS

# Each backend's Comm class, and the protocols its facts promise (elastic: ElasticGroup; NumPy sums: HostVectors).
CLASSES = {
    "torch": ("multigpu.engine.comm", (Group, ElasticGroup)),
    "tensorflow": ("multigpu.backend.tensorflow.collectives", (Group, ElasticGroup, HostVectors)),
    "jax": ("multigpu.backend.jax.collectives", (Group, HostVectors)),
}


def declared(protocol: type) -> list[str]:
    """The members ``protocol`` declares, its bases' included."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        for name in (*getattr(cls, "__annotations__", {}), *vars(cls)):
            if not name.startswith("_") and name not in names:
                names.append(name)
    return names


def _comm_class(backend: str):
    import importlib

    return importlib.import_module(CLASSES[backend][0]).Comm


def _parameters(function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(function).parameters.values())[1:]]


@pytest.mark.parametrize("backend", list(CLASSES))
def test_every_comm_declares_its_protocols_methods_with_their_signatures(backend):
    import importlib

    cls = _comm_class(backend)
    protocols = CLASSES[backend][1]
    assert (ElasticGroup in protocols) == importlib.import_module(f"multigpu.backend.{backend}.facts").FACTS.elastic
    checked = 0
    for protocol in protocols:
        for name in declared(protocol):
            wanted = getattr(protocol, name, None)
            if not inspect.isfunction(wanted):
                continue  # an attribute or a property: checked on a live instance below
            mine = inspect.getattr_static(cls, name, None)
            if mine is None:  # set on the instance (TensorFlow's fatal is the engine's): checked live
                continue
            assert inspect.isfunction(mine), (backend, name, mine)
            assert _parameters(mine) == _parameters(wanted), (backend, name)
            checked += 1
    assert checked >= 6, (backend, checked)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", list(CLASSES))
def test_every_comm_does_the_same_on_a_real_run(runner, backend):
    if backend != "torch":
        pytest.importorskip(backend, reason=f"needs {backend} (make test installs it)")
    protocols = CLASSES[backend][1]
    promised = [name for name, p in (("host_vectors", HostVectors), ("elastic", ElasticGroup)) if p in protocols]
    res = runner.run([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1",
                      str(SCRIPTS / "collectives.py"), str(runner.tmp_path / "seen"), *promised], timeout=200,
                     extra_env={"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert res.returncode == 0, res.stdout[-3000:]
    seen = [json.loads((runner.tmp_path / f"seen.{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(seen):
        # isinstance checks that the members are there (their signatures: the test above)
        assert got["group"] and (got["elastic"] or ElasticGroup not in protocols), got
        assert got["host_vectors"] or HostVectors not in protocols, got
        assert (got["rank"], got["world_size"], got["leader"], got["joining"], got["rejoined"]) == (r, 2, 0, False,
                                                                                                    False)
        assert got["sum_floats"] == [4.0, -1.0] and got["fatal"] == "entered"
        assert got["gather_objects"] == [{"rank": 0, "text": "x"}, {"rank": 1, "text": "xx"}]
        assert got["gather_long"] == [2000, 4000]
        assert got["seeds"][0] == got["seeds"][1] and got["seeds"][0] >= 0
        assert got["shared"] == {"from": 1}
        assert got["published"] == [{"from": 0, "n": 0}, {"from": 1, "n": 1}, {"from": 0, "n": 2}]
        assert got["store_left"] == []  # each reader took its copy out of the store
        assert got["peek_before"] is None and got["peeked"] == {"n": 2, "a": [0.0, 1.0]}
        assert got["check_same"] == ("The ranks received different data: the number of rows differ (rank 0: 100, "
                                     "rank 1: 101). Every rank must see the same data (build or load it the same "
                                     "way on every rank).")
        if HostVectors in protocols:
            assert got["reduce"] == [3.0, 5.0]
            assert got["broadcast_leader"] == [[0.0, 1.0, 2.0], [0]] and got["broadcast_1"] == [[0.0, 2.0]]
        if ElasticGroup in protocols:
            assert got["members"] == [0, 1] and got["generation"] == 0 and got["share"] == {"from": 1}
    assert seen[1]["publish_seconds"] < 0.5, seen[1]  # the publisher did not wait the second rank 0 was away
    # CPU devices of one x86-64 machine sum through shared memory on every backend (JAX's float32 sums too)
    x86 = platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")
    assert seen[0]["transport"] == seen[1]["transport"] == ("shm" if x86 else "gloo")
    assert runner.leftovers() == []


@pytest.mark.parametrize(("backend", "transport"), [("torch", "shm"), ("torch", "gloo"), ("jax", "shm")])
def test_sums_over_part_of_the_ranks_then_over_every_rank(runner, backend, transport):
    """The step's sums of the devices left while others are set aside (``among``): over those ranks only, as often
    as they step, without touching what the rank set aside last summed with them (on shared memory they have a
    segment of their own), and over every rank again after.  TensorFlow's ``Comm`` is the engine's (torch's)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")
    if transport == "shm" and not x86:
        pytest.skip("shared memory needs CPU devices of one x86-64 machine")
    if backend != "torch":
        pytest.importorskip(backend, reason=f"needs {backend} (make test installs it)")
    res = runner.run([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:0,cpu:1,cpu:2",
                      str(SCRIPTS / "subgroups.py"), str(runner.tmp_path / "seen"), transport], timeout=200,
                     extra_env={"KERAS_BACKEND": backend})
    assert res.returncode == 0, res.stdout[-3000:]
    seen = [json.loads((runner.tmp_path / f"seen.{r}.json").read_text()) for r in range(3)]
    every = [6.0, 300.0]
    for r, got in enumerate(seen):
        assert got["transport"] == transport and got["sums_among"] and got["formed"], got
        first, second = got["rounds"]
        assert first["among"] == ([[3.0, 30.0 + 2 * i] for i in range(3)] if r in (0, 1) else []), got
        assert second["among"] == ([[5.0, 50.0 + 2 * i] for i in range(2)] if r in (1, 2) else []), got
        assert first["every"] == second["every"] == every and got["first"] == [6.0, 0.0], got
        # the rank set aside reads its last sum over every rank after the others summed among themselves
        assert first["late"] == ([6.0, 0.0] if r == 2 else None) and second["late"] == (every if r == 0 else None)
    assert runner.leftovers() == []
