"""Benchmark runs: each configuration in fresh processes, one after another.

Kinds of run (``mode``):

* ``multigpu``: the model through :func:`multigpu.parallelize` on the chosen
  devices and shares;
* ``solo``: one device alone at its share of the batch (for balance
  efficiency: total samples/s over the sum of every device's solo samples/s);
* ``single``: plain Keras ``model.fit`` without multigpu, on one device;
* ``ddp``: PyTorch DDP driving the same Keras model with equal shares and its
  own training loop, as Keras's guide for the torch backend does;
* ``keras-ddp``: Keras's own ``fit`` with the model wrapped in DDP and metrics
  summed over ranks, equal shares: what Keras 3.16 does by itself, written out;
* ``keras-fit-ddp`` (torch, Keras 3.16 and newer): Keras's own ``fit`` under a
  torch process group, which wraps the model in DDP itself, equal shares;
* ``keras-dp`` (JAX): Keras's own ``keras.distribution.DataParallel`` in one
  process whose CPU is split into one XLA host device per listed device,
  equal shares, on the listed devices' cores (``capacity``: CPU time in cores);
* ``keras-dp-procs`` (JAX): the same over one process per listed device, each
  a device of its own at its speed (``cpu:1@0.5``), equal shares;
* ``tf-mirrored`` (TensorFlow): Keras's own ``fit`` under
  ``tf.distribute.MirroredStrategy`` in one process, one logical CPU device per
  listed device, on the listed devices' cores, equal shares;
* ``calibrate``: one device alone at growing batch sizes.

Every run reports steady-state samples/s (the first ``warmup`` steps are not
timed).  The per-rank program is :mod:`multigpu.bench.worker`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from multigpu import env

__all__ = ["ALONE_MODES", "BASELINE_MODES", "MODES", "baselines_file", "run_config", "run_in_turn",
           "solo_devices_config"]

MODES = ("multigpu", "solo", "single", "ddp", "keras-ddp", "keras-fit-ddp", "keras-dp", "keras-dp-procs", "tf-mirrored",
         "calibrate")
ALONE_MODES = ("single", "solo", "calibrate", "keras-dp", "tf-mirrored")  # one process each
BASELINE_MODES = ("ddp", "keras-ddp", "keras-fit-ddp", "keras-dp", "keras-dp-procs", "tf-mirrored")


def baselines_file() -> Path | None:
    """``benchmarks/baselines.py`` of the checkout this package runs from, or None where it is not there.

    The other frameworks' data-parallel loops a benchmark compares with are
    laboratory code: they live beside the benchmarks, not in the installed
    package.
    """
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "baselines.py"
    return path if path.exists() else None


def _pinned(cores):
    def pre():
        from multigpu.runtime.processes import die_with_parent

        if cores:
            os.sched_setaffinity(0, cores)
        die_with_parent()
    return pre


def run_config(config: dict, timeout: float = 1800, stream: bool = True, keep_log: bool = False) -> dict:
    """Runs one configuration in fresh processes and returns rank 0's result.

    Args:
        config: ``mode``, ``model``, ``width``, ``devices`` (specs), ``batch``,
            ``ratios``, ``steps``, ``warmup``, ``print_every``, ``env`` (extra environment variables).
        timeout: seconds before the run is stopped and reported as failed.
        stream: let rank 0 print its progress lines.
        keep_log: (with ``stream=False``) return multigpu's own log lines
            (calibration, share moves) as the result's ``log``.

    Raises:
        RuntimeError: when a rank fails or the run takes longer than ``timeout``.
    """
    from multigpu.devices import assign_cores, parse_devices
    from multigpu.runtime.supervisor import Supervisor

    if config["mode"] not in MODES:
        raise ValueError(f"unknown benchmark mode {config['mode']!r}; allowed: {', '.join(MODES)}")
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="multigpu-bench-"))
        out = Path(tmp) / "result.json"
        cfg = dict(config, out=str(out))
        if config["mode"] in BASELINE_MODES:
            path = baselines_file()
            if path is None:
                raise ValueError(f"the {config['mode']!r} baseline is laboratory code kept in the repository's "
                                 "benchmarks/baselines.py, which this installation does not have: run it from a "
                                 "checkout of multigpu (pip install -e .)")
            cfg["baselines"] = str(path)
        devices = assign_cores(parse_devices(config["devices"]), warn=False)
        log_path = Path(tmp) / "output.txt"
        log_file = stack.enter_context(open(log_path, "w")) if keep_log and not stream else None
        stdout = None if stream else (log_file or subprocess.DEVNULL)
        if config["mode"] in ALONE_MODES:
            proc = _start_alone(cfg, Path(tmp), stdout)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"benchmark run timed out after {timeout:.0f} s: {config}") from None
            if code != 0:
                raise RuntimeError(f"benchmark run failed with exit code {code}: {config}")
        else:
            (Path(tmp) / "config.json").write_text(json.dumps(cfg))
            ratios = config.get("ratios")
            text = None if ratios is None else (ratios if isinstance(ratios, str) else ",".join(map(str, ratios)))
            group = Supervisor(_command(Path(tmp)), devices, 120.0, ratios=text,
                               env_extra={"PYTHONWARNINGS": "ignore", **config.get("env", {})}, stdout=stdout)
            group.start()
            deadline = time.monotonic() + timeout
            try:
                while True:
                    failure = group.failure()
                    if failure is not None:
                        raise RuntimeError(f"benchmark run failed: {group.describe_failure(*failure)}")
                    if all(p.poll() == 0 for p in group.procs):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"benchmark run timed out after {timeout:.0f} s: {config}")
                    time.sleep(0.05)
            finally:
                group.stop(grace=3.0)
        result = json.loads(out.read_text())
        if log_file is not None:
            log_file.flush()
            result["log"] = [ln for ln in log_path.read_text().splitlines() if ln.startswith("multigpu:")]
        return result


def run_in_turn(configs: list[dict], timeout: float = 1800) -> list[dict]:
    """Runs one-process configurations (``calibrate``, ``solo``, ``single``) one at a time, their processes all
    started at once: they import and build side by side, then each waits for its turn (``turn``: it goes once
    every one is ready and the one before it has ended), so that each measures alone and the starts cost one.

    Args:
        configs: the configurations, as :func:`run_config` takes them (their output not shown).
        timeout: seconds for them all.

    Returns:
        Each one's result, in order.

    Raises:
        RuntimeError: when a process fails or they take longer than ``timeout``.
    """
    allowed = [m for m in ALONE_MODES if m not in BASELINE_MODES]  # (a baseline's process needs run_config's set-up)
    for config in configs:
        if config["mode"] not in allowed:
            raise ValueError(f"run_in_turn runs one process each of multigpu's own ({', '.join(allowed)}). "
                             f"Received: mode {config['mode']!r}")
    deadline = time.monotonic() + timeout

    def left() -> float:
        if time.monotonic() > deadline:
            raise RuntimeError(f"benchmark runs timed out after {timeout:.0f} s: {configs}")
        return deadline - time.monotonic()

    with tempfile.TemporaryDirectory(prefix="multigpu-bench-") as tmp:
        started = []
        try:
            for i, config in enumerate(configs):
                folder = Path(tmp) / str(i)
                folder.mkdir()
                cfg = dict(config, out=str(folder / "result.json"), turn=str(folder / "turn"))
                started.append((_start_alone(cfg, folder, subprocess.DEVNULL), folder))
            for proc, folder in started:  # every one ready, or ended (its turn then reports it)
                while not (folder / "turn.ready").exists() and proc.poll() is None:
                    left()
                    time.sleep(0.01)
            results = []
            for (proc, folder), config in zip(started, configs):
                (folder / "turn.go").touch()
                try:
                    code = proc.wait(left())
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"benchmark runs timed out after {timeout:.0f} s: {config}") from None
                if code != 0:
                    raise RuntimeError(f"benchmark run failed with exit code {code}: {config}")
                results.append(json.loads((folder / "result.json").read_text()))
            return results
        finally:
            for proc, _ in started:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _command(folder: Path) -> list[str]:
    """The worker's command line, for the configuration in ``folder/config.json``."""
    return [sys.executable, "-m", "multigpu.runtime.rank_entry", "module", "multigpu.bench.worker",
            str(folder / "config.json")]


def _start_alone(cfg: dict, folder: Path, stdout) -> subprocess.Popen:
    """Starts a one-process configuration (its ``out`` set) in ``folder``, on its cores (``cores``, else the
    first device's; every listed device's for ``tf-mirrored``)."""
    from multigpu.devices import assign_cores, parse_devices

    devices = assign_cores(parse_devices(cfg["devices"]), warn=False)
    every = sorted({c for d in devices for c in d.cores})
    cfg = dict(cfg, cores=list(cfg.get("cores") or (every if cfg["mode"] == "tf-mirrored" else devices[0].cores)))
    (folder / "config.json").write_text(json.dumps(cfg))
    variables = {**env.copy(), "KERAS_BACKEND": env.keras_backend(), "OMP_NUM_THREADS": "1",
                 "PYTHONWARNINGS": "ignore", **cfg.get("env", {})}  # the configuration's last: its backend
    return subprocess.Popen(_command(folder), env=variables, preexec_fn=_pinned(cfg["cores"]), stdout=stdout)


def solo_devices_config(config: dict, shares: list[int]) -> list[dict]:
    """One ``solo`` configuration per device, each at its share of the batch, on that device's cores."""
    from multigpu.devices import assign_cores, parse_devices

    devices = assign_cores(parse_devices(config["devices"]), warn=False)
    out = []
    for dev, share in zip(devices, shares):
        spec = dev.spec if dev.is_cuda else "cpu:0" + (f"@{dev.speed:g}" if dev.speed != 1.0 else "")
        out.append(dict(config, mode="solo", devices=[spec], batch=max(1, share), ratios=None,
                        cores=list(dev.cores), label=dev.label))
    return out
