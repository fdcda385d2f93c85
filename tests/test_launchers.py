"""Launchers: who started a rank (multigpu, torchrun, SLURM, MPI, Kubernetes' variables), and arguments over variables.

The launcher classes are read from made-up environments here; a real ``slurmd`` (Debian's
``slurm-wlm``, started by the ``slurm`` fixture as root with ``auth/none``), two SLURM nodes in two
network namespaces (the ``two_nodes`` fixture) and a real Open MPI ``mpirun`` run
``tests/scripts/tiny.py`` on two processes at 3:1 as one device does (1e-5), on torch and JAX. Where
SLURM or Open MPI is not installed or cannot start, those tests are skipped and say why
(``make test-launchers`` installs both).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from multigpu.runtime import environments as envs
from tests.conftest import SCRIPTS
from tests.test_launch import read

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1433665537"}


def test_each_launcher_is_read_from_its_own_variables():
    s = envs.detect(SLURM)
    assert isinstance(s, envs.Slurm)
    assert (s.rank, s.world_size, s.local_rank, s.local_size, s.master_addr) == (3, 4, 1, 2, "gpu07")
    assert not s.same_host and s.host_leader == 2
    assert envs.detect(SLURM).master_port == s.master_port  # every task derives the same port
    assert envs.detect({**SLURM, "MASTER_PORT": "29600", "MASTER_ADDR": "login1"}).master_port == 29600
    m = envs.detect(OMPI)
    assert isinstance(m, envs.Mpi) and (m.rank, m.world_size, m.local_rank, m.local_size) == (1, 2, 1, 2)
    assert m.same_host and m.master_addr == "127.0.0.1"
    pmi = envs.detect({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert isinstance(pmi, envs.Mpi) and pmi.world_size == 2
    t = envs.detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500", "LOCAL_RANK": "1",
                     "LOCAL_WORLD_SIZE": "2"})
    assert isinstance(t, envs.TorchRun) and t.same_host and t.coordinator == "h:29501"
    # Kubernetes' PyTorchJob: torch's variables without a local rank, one process per pod
    k = envs.detect({"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert isinstance(k, envs.TorchRun) and (k.local_rank, k.local_size, k.same_host) == (0, 1, False)
    sup = envs.detect({"MULTIGPU_RANK": "1", "MULTIGPU_WORLD_SIZE": "2", "MULTIGPU_MASTER_PORT": "4000"})
    assert isinstance(sup, envs.Supervised) and sup.knows_every_device and sup.coordinator == "127.0.0.1:4000"


def test_a_shell_of_a_batch_script_or_a_single_task_is_a_process_alone():
    batch_shell = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}  # sbatch's own script: no step
    assert envs.detect(batch_shell) is None
    assert envs.detect({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_STEP_TASKS_PER_NODE": "1"}) is None
    assert envs.detect({**OMPI, "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) is None
    assert envs.detect({}) is None


def test_bad_launcher_variables_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"SLURM_PROCID must be an integer. Received: SLURM_PROCID='x'"):
        envs.detect({**SLURM, "SLURM_PROCID": "x"})
    with pytest.raises(ValueError, match=r"mpirun -x MASTER_ADDR"):
        envs.detect({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})  # two machines, no rendezvous host


@pytest.mark.parametrize(("nodelist", "first"), [("vm", "vm"), ("node[03-05,9],gpu1", "node03"),
                                                 ("a1,a2", "a1"), ("gpu[7]", "gpu7")])
def test_the_rendezvous_is_on_the_first_node_slurm_lists(nodelist, first):
    assert envs.first_host(nodelist) == first


# ---------------------------------------------------------------- real launchers
BACKENDS = {"torch": {"KERAS_BACKEND": "torch"}, "jax": {"KERAS_BACKEND": "jax", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}}
TINY = ["--devices", "auto", "--rows", "50", "--batch", "16", "--ratios", "3,1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(folder: Path, controller: str, nodes: list[str], names: str) -> Path:
    """A slurm.conf in ``folder`` for ``nodes`` (``NodeName=`` lines), all in one partition ``test``."""
    for sub in ("state", *(f"spool-{n.split()[0].split('=')[1]}" for n in nodes)):
        (folder / sub).mkdir(exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=multigpu", f"SlurmctldHost={controller}", f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}", "AuthType=auth/none", "CredType=cred/none", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "ReturnToService=2", "SlurmUser=root", "SlurmdUser=root", "MpiDefault=none",
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}-%n",
        f"SlurmctldPidFile={folder / 'ctld.pid'}", f"SlurmdPidFile={folder / 'd'}-%n.pid",
        f"SlurmctldLogFile={folder / 'ctld.log'}", f"SlurmdLogFile={folder / 'd'}-%n.log",
        *nodes, f"PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP", ""]))
    return conf


def _slurm_up(daemons: list, folder: Path, env: dict, prefix: list[str], nodes: int) -> None:
    """Waits until ``nodes`` nodes are idle; skips (with the daemons' logs) when they do not come up."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(d.poll() is not None for d in daemons):
        state = subprocess.run([*prefix, "sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True,
                               check=False)
        if state.stdout.split().count("idle") + state.stdout.split().count("mix") == nodes:
            return
        time.sleep(0.5)
    log = "".join(p.read_text()[-800:] for p in sorted(folder.glob("*.log")))
    pytest.skip(f"slurmctld/slurmd did not come up here: {log or 'no log'}")


def _stop(daemons: list) -> None:
    for d in daemons:
        d.terminate()
    for d in daemons:
        try:
            d.wait(10)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()


def _slurm_installed() -> None:
    missing = [b for b in ("slurmctld", "slurmd", "srun") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM is not installed here ({', '.join(missing)} missing): `make test-launchers` installs "
                    "Debian's slurm-wlm")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One slurmctld and one slurmd on this machine (auth/none, two CPUs), stopped at the end."""
    _slurm_installed()
    folder = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname()
    conf = _slurm_conf(folder, host, [f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN"], host)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen([d, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT) for d in ("slurmctld", "slurmd")]
    try:
        _slurm_up(daemons, folder, env, [], 1)
        yield {"SLURM_CONF": str(conf)}
    finally:
        _stop(daemons)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two SLURM nodes, ``node1`` and ``node2``, each a network namespace of its own (joined by a veth pair), with
    a hostname of its own (a UTS namespace) and an ``/etc/hosts`` naming both; slurmctld runs on ``node1``.

    Yields the ``SLURM_CONF`` variable and the command prefix that runs a program on ``node1`` (``srun`` from
    there reaches both). Each node declares the machine's two CPUs; ``--devices cpu:0,cpu:1`` puts one rank on
    each core.
    """
    _slurm_installed()
    from benchmarks.links import Link, unavailable

    why = unavailable()
    if why or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip(f"two nodes need network namespaces: {why or 'unshare and nsenter (util-linux) are missing'}")
    folder = tmp_path_factory.mktemp("slurm2")
    with Link(None, tag=f"s{os.getpid() % 10000}") as link:
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n{link.addresses[0]} node1\n{link.addresses[1]} node2\n")

        def on(node: int, argv: list[str]) -> list[str]:
            return link.command(node, ["unshare", "--mount", "--uts", "sh", "-c",
                                       f'mount --bind {folder / "hosts"} /etc/hosts && hostname node{node + 1} && '
                                       'exec "$@"', "sh", *argv])

        conf = _slurm_conf(folder, f"node1({link.addresses[0]})",
                           [f"NodeName=node{i + 1} NodeAddr={link.addresses[i]} CPUs={os.cpu_count()} State=UNKNOWN"
                            for i in range(2)], "node1,node2")
        env = {**os.environ, "SLURM_CONF": str(conf)}
        daemons = [subprocess.Popen(on(node, [d, "-D", "-f", str(conf)]), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.STDOUT)
                   for node, d in ((0, "slurmctld"), (0, "slurmd"), (1, "slurmd"))]
        try:
            _slurm_up(daemons, folder, env, on(0, []), 2)
            yield {"SLURM_CONF": str(conf)}, on(0, [])
        finally:
            _stop(daemons)


def _compare_with_one_device(runner, backend: str, name: str) -> None:
    """The launcher's run at 3:1 against plain Keras on one device (``--devices cpu:0``: parallelize changes
    nothing), the same data, batches and seed."""
    one = runner.run([sys.executable, str(SCRIPTS / "tiny.py"), "--devices", "cpu:0", "--rows", "50", "--batch", "16",
                      "--out", "one"], timeout=120, extra_env=BACKENDS[backend])
    assert one.returncode == 0, one.stdout
    got, ref = read(runner, name, 0), read(runner, "one", 0)
    assert got["world_size"] == 2
    for a, b in zip(got["weights"], ref["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    other = read(runner, name, 1)
    assert other["weights"] == got["weights"]
    assert runner.leftovers() == []


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_srun_runs_two_tasks_as_one_run_equal_to_one_device(runner, slurm, backend):
    """``srun -n 2 python train.py`` (torch) and ``srun -n 2 multigpu run train.py`` (any backend: it joins before
    the script runs): each task is one rank of one run, not a supervisor of its own."""
    if backend == "jax":
        pytest.importorskip("jax")
    program = ([sys.executable, str(SCRIPTS / "tiny.py")] if backend == "torch" else
               [sys.executable, "-m", "multigpu", "run", str(SCRIPTS / "tiny.py")])
    res = runner.run(["srun", "-n", "2", "--kill-on-bad-exit=1", *program, *TINY, "--out", "srun"], timeout=150,
                     extra_env={**slurm, **BACKENDS[backend]})
    assert res.returncode == 0, res.stdout
    assert "multigpu: started by SLURM: 2 ranks on 1 machine(s)" in res.stdout, res.stdout
    _compare_with_one_device(runner, backend, "srun")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_srun_over_two_nodes_is_one_run_equal_to_one_device(runner, two_nodes, backend):
    """``srun -N 2 -n 2``: one rank on each of two SLURM nodes (two network namespaces), meeting at the first node
    over the link between them (gloo, found from the node's hostname)."""
    if backend == "jax":
        pytest.importorskip("jax")
    slurm_env, on_node1 = two_nodes
    program = ([sys.executable, str(SCRIPTS / "tiny.py")] if backend == "torch" else
               [sys.executable, "-m", "multigpu", "run", str(SCRIPTS / "tiny.py")])
    args = ["--devices", "cpu:0,cpu:1", *TINY[2:]]
    res = runner.run([*on_node1, "srun", "-N", "2", "-n", "2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                      *program, *args, "--out", "nodes"], timeout=180, extra_env={**slurm_env, **BACKENDS[backend]})
    assert res.returncode == 0, res.stdout
    assert "multigpu: started by SLURM: 2 ranks on 2 machine(s), rendezvous at node1:" in res.stdout, res.stdout
    _compare_with_one_device(runner, backend, "nodes")


def _mpirun() -> list[str]:
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed here: `make test-launchers` installs Debian's openmpi-bin")
    return ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"] + (
        ["--allow-run-as-root"] if os.geteuid() == 0 else [])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_mpirun_runs_two_processes_as_one_run_equal_to_one_device(runner, backend):
    if backend == "jax":
        pytest.importorskip("jax")
    program = ([sys.executable, str(SCRIPTS / "tiny.py")] if backend == "torch" else
               [sys.executable, "-m", "multigpu", "run", str(SCRIPTS / "tiny.py")])
    res = runner.run([*_mpirun(), *program, *TINY, "--out", "mpi"], timeout=150, extra_env=BACKENDS[backend])
    assert res.returncode == 0, res.stdout
    assert "multigpu: started by MPI: 2 ranks on 1 machine(s)" in res.stdout, res.stdout
    _compare_with_one_device(runner, backend, "mpi")


# ------------------------------------------------------ arguments over variables
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_command_line_wins_over_the_scripts_arguments_and_the_run_says_so(runner):
    """One rule for every flag: what ``multigpu run`` is given for this run wins over the script's ``devices``,
    ``ratios`` and ``timeout``, and rank 0 says so for each in one line (a flag left out leaves the script's:
    ``env.fallback``, below)."""
    res = runner.cli("run", "--devices", "cpu:0,cpu:1", "--ratios", "1,1", "--timeout", "30", str(SCRIPTS / "tiny.py"),
                     "--rows", "64", "--batch", "16", "--ratios", "3,1", "--devices", "cpu:1,cpu:0", "--out", "args",
                     timeout=90)
    assert res.returncode == 0, res.stdout
    given = "(given to multigpu run or multigpu.launch) wins over"
    assert res.stdout.count(f"multigpu: --ratios 1,1 {given} ratios=[3.0, 1.0] given to parallelize") == 1
    assert f"multigpu: --timeout 30 {given} timeout=20.0 given to parallelize" in res.stdout, res.stdout
    assert (f"multigpu: --devices cpu:0,cpu:1 {given} devices=['cpu:1', 'cpu:0'] given to parallelize: the ranks' "
            "processes run there") in res.stdout, res.stdout
    assert read(runner, "args", 0)["shares"] == [8, 8]
    assert runner.leftovers() == []


def test_unset_arguments_fall_back_to_the_variables_and_set_ones_win(monkeypatch):
    """A variable the user set counts where the argument is unset; one given for the run (multigpu run, launch)
    wins over the argument."""
    from multigpu import env

    monkeypatch.setenv(env.TRANSPORT, "gloo")
    monkeypatch.setenv(env.GIVEN, "")  # undone after the test, with what env.given adds
    assert env.fallback("transport", None, env.TRANSPORT) == "gloo"
    said: list[str] = []
    assert env.fallback("transport", "shm", env.TRANSPORT, say=said.append) == "shm"
    assert said == ["transport='shm' given to parallelize wins over MULTIGPU_TRANSPORT=gloo"]
    assert env.fallback("transport", "gloo", env.TRANSPORT, say=said.append) == "gloo" and len(said) == 1
    monkeypatch.delenv(env.TRANSPORT)
    assert env.fallback("transport", None, env.TRANSPORT) is None
    monkeypatch.setenv(env.RATIOS, "3,1")
    env.given(env.DEVICES, env.RATIOS)
    env.given(env.RATIOS)
    assert env.get(env.GIVEN) == f"{env.DEVICES},{env.RATIOS}"
    assert env.fallback("ratios", [1.0, 1.0], env.RATIOS, lambda t: [float(r) for r in t.split(",")],
                        say=said.append) == [3.0, 1.0]
    assert said[-1] == ("--ratios 3,1 (given to multigpu run or multigpu.launch) wins over ratios=[1.0, 1.0] given "
                        "to parallelize")


def test_nothing_below_env_and_the_launchers_reads_the_environment():
    """Every variable multigpu reads goes through ``multigpu/env.py`` or a launcher class, where it is listed."""
    root = Path(__file__).resolve().parent.parent / "multigpu"
    allowed = {root / "env.py", root / "runtime" / "environments.py"}
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path in allowed:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "os.environ" in line or "os.getenv" in line:
                offenders.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
