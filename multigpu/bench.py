"""Benchmarking: samples/s per device, sweeps over batch sizes, baselines.

Every configuration runs in fresh processes (one per device), one after
another, and reports steady-state samples/s (the first ``warmup`` steps are
not timed).  Kinds of run:

* ``multigpu``: the model through :func:`multigpu.parallelize` on the chosen
  devices and shares;
* ``solo``: one device alone at its share of the batch (for balance
  efficiency: total samples/s over the sum of every device's solo samples/s);
* ``single``: plain Keras ``model.fit`` without multigpu, on one device;
* ``ddp``: PyTorch DDP driving the same Keras model with equal shares and its
  own training loop, as Keras's guide for the torch backend does.

``python -m multigpu.bench CONFIG.json`` is the per-rank worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["run_config", "solo_devices_config"]

_HERE = Path(__file__).resolve().parent


def _pin(cores):
    def pre():
        from multigpu.processes import die_with_parent

        if cores:
            os.sched_setaffinity(0, cores)
        die_with_parent()
    return pre


def run_config(config: dict, timeout: float = 1800, stream: bool = True) -> dict:
    """Runs one configuration in fresh processes and returns rank 0's result.

    Args:
        config: ``mode``, ``model``, ``width``, ``devices`` (specs), ``batch``,
            ``ratios``, ``steps``, ``warmup``, ``print_every``.
        timeout: seconds before the run is stopped and reported as failed.
        stream: let rank 0 print its progress lines.
    """
    from multigpu.devices import assign_cores, parse_devices
    from multigpu.processes import RankGroup

    with tempfile.TemporaryDirectory(prefix="multigpu-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cfg_path = Path(tmp) / "config.json"
        cfg = dict(config, out=str(out))
        cfg_path.write_text(json.dumps(cfg))
        command = [sys.executable, "-m", "multigpu.rank_entry", "module", "multigpu.bench", str(cfg_path)]
        env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        devices = assign_cores(parse_devices(config["devices"]))
        deadline = time.monotonic() + timeout
        if config["mode"] in ("single", "solo"):
            cores = list(config.get("cores") or devices[0].cores)
            cfg["cores"] = cores
            cfg_path.write_text(json.dumps(cfg))
            proc = subprocess.Popen(command, env=env, preexec_fn=_pin(cores),
                                    stdout=None if stream else subprocess.DEVNULL)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"benchmark run timed out after {timeout:.0f} s: {config}") from None
            if code != 0:
                raise RuntimeError(f"benchmark run failed with exit code {code}: {config}")
        else:
            os.environ.setdefault("KERAS_BACKEND", "torch")
            ratios = config.get("ratios")
            group = RankGroup(command, devices, None if ratios is None else ratios, 120.0,
                              env_extra={"KERAS_BACKEND": "torch", "PYTHONWARNINGS": "ignore"})
            try:
                while True:
                    failure = group.failure()
                    if failure is not None:
                        raise RuntimeError(f"benchmark run failed: {group.describe_failure(*failure)}")
                    if all(p.poll() == 0 for p in group.procs):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"benchmark run timed out after {timeout:.0f} s: {config}")
                    time.sleep(0.1)
            finally:
                group.stop(grace=3.0)
        return json.loads(out.read_text())


def solo_devices_config(config: dict, shares: list[int]) -> list[dict]:
    """One ``solo`` configuration per device, each at its share of the batch."""
    from multigpu.devices import assign_cores, parse_devices

    devices = assign_cores(parse_devices(config["devices"]))
    out = []
    for dev, share in zip(devices, shares):
        spec = dev.spec.split(":")[0] + ":0" + (f"@{dev.speed:g}" if dev.speed != 1.0 else "")
        if dev.is_cuda:
            spec = dev.spec
        out.append(dict(config, mode="solo", devices=[spec], batch=max(1, share), ratios=None,
                        cores=list(dev.cores), label=dev.label))
    return out


# --------------------------------------------------------------- the worker
def _timing_callback(batch: int, warmup: int, print_every: int, state=None):
    import keras

    class Timer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.samples = 0
            self.next_print = print_every

        def on_train_batch_end(self, step, logs=None):
            self.times.append(time.perf_counter())
            self.samples += batch
            self.loss = float((logs or {}).get("loss", float("nan")))
            if print_every and self.samples >= self.next_print and len(self.times) > warmup + 1:
                self.next_print += print_every
                _print_progress(self.samples, batch, self.rate(), state)

        def rate(self) -> float:
            timed = self.times[warmup:]
            if len(timed) < 2:
                return float("nan")
            return batch * (len(timed) - 1) / (timed[-1] - timed[0])

    return Timer()


def _print_progress(samples: int, batch: int, total_rate: float, state) -> None:
    from multigpu import rank

    if rank() != 0:
        return
    print(f"After {samples} samples", flush=True)
    if state is not None:
        shares = state.shares_for(batch)
        for dev, share in zip(state.runtime.devices, shares):
            print(f"{dev.label}[{share}] {total_rate * share / batch:.0f} sps", flush=True)
    print(f"Total:[{batch}] {total_rate:.0f} sps", flush=True)


def _worker(cfg: dict) -> None:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras

    from multigpu.models import get_model

    spec = get_model(cfg["model"])
    batch, steps, warmup = int(cfg["batch"]), int(cfg["steps"]), int(cfg.get("warmup", 2))
    rows = batch * (steps + warmup)
    keras.utils.set_random_seed(int(cfg.get("seed", 0)))
    mode = cfg["mode"]
    if mode == "calibrate":
        return _calibrate_worker(cfg, spec)
    if mode == "ddp":
        return _ddp_worker(cfg, spec, batch, steps, warmup)
    import torch

    if mode == "single":
        torch.set_num_threads(max(1, len(cfg.get("cores") or [0])))
    model = spec.build(float(cfg.get("width", 1.0)))
    state = None
    if mode in ("multigpu", "solo"):
        import multigpu

        ratios = cfg.get("ratios")
        kwargs = {}
        if ratios == "auto":
            kwargs = {"recalibrate": True, "profile": str(Path(cfg["out"]).with_suffix(".profile.json"))}
        model = multigpu.parallelize(model, devices=cfg["devices"], ratios=ratios, **kwargs)
        state = model._multigpu_state
    spec.compile(model)
    x, y = spec.data(rows, 0)
    timer = _timing_callback(batch, warmup, int(cfg.get("print_every", 0)), state)
    hist = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    from multigpu import rank

    if rank() != 0:
        return
    result = {
        "mode": mode, "config": cfg, "samples_per_second": timer.rate(),
        "loss": float(hist.history["loss"][-1]), "time_per_step": batch / timer.rate(),
    }
    if state is not None:
        result["ratios"] = list(state.ratios)
        result["shares"] = state.shares_for(batch)
        result["devices"] = [d.label for d in state.runtime.devices]
        result["report"] = state.last_report
    Path(cfg["out"]).write_text(json.dumps(result))


def _ddp_worker(cfg, spec, batch, steps, warmup) -> None:
    import keras
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from multigpu import launch
    from multigpu.planning import split

    runtime = launch.start(cfg["devices"], None, 120.0)  # binds this rank, joins the group
    model = spec.build(float(cfg.get("width", 1.0)))
    spec.compile(model)  # for the loss; the loop uses a torch optimizer
    x, y = spec.data(batch * (steps + warmup), 0)
    model(x[:1])  # build
    ddp = DistributedDataParallel(model) if runtime.world_size > 1 else model
    opt_name = type(model.optimizer).__name__.lower()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = {"rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3),
                 "adam": lambda: torch.optim.Adam(params, lr=1e-3)}.get(
        opt_name, lambda: torch.optim.SGD(params, lr=1e-2))()
    loss_fn = model.loss if callable(model.loss) else keras.losses.get(model.loss)
    local = split(batch, [1.0] * runtime.world_size)
    begin = sum(local[: runtime.rank])
    times, loss = [], float("nan")
    for step in range(steps + warmup):
        start = step * batch + begin
        xb = torch.from_numpy(x[start : start + local[runtime.rank]])
        yb = torch.from_numpy(y[start : start + local[runtime.rank]])
        optimizer.zero_grad()
        out = ddp(xb, training=True)
        value = torch.mean(loss_fn(yb, out))
        value.backward()
        optimizer.step()
        loss = float(value.detach())
        times.append(time.perf_counter())
    if runtime.world_size > 1:
        dist.barrier()
    if runtime.rank == 0:
        timed = times[warmup:]
        rate = batch * (len(timed) - 1) / (timed[-1] - timed[0]) if len(timed) > 1 else float("nan")
        Path(cfg["out"]).write_text(json.dumps({
            "mode": "ddp", "config": cfg, "samples_per_second": rate, "loss": loss,
            "time_per_step": batch / rate, "shares": local,
        }))


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return 0


def _calibrate_worker(cfg, spec) -> None:
    """Solo samples/s at each batch size, up to the largest that fits."""
    import torch

    import multigpu
    from multigpu.calibrate import model_signature, solo_speed

    model = spec.build(float(cfg.get("width", 1.0)))
    model = multigpu.parallelize(model, devices=cfg["devices"], ratios=None)
    spec.compile(model)
    device = model._multigpu_state.runtime.device
    budget = cfg.get("memory_budget")
    rows = []
    for size in cfg["sizes"]:
        x, y = spec.data(int(size), 0)
        if device.is_cuda:
            torch.cuda.reset_peak_memory_stats(device.index)
        try:
            if device.is_cuda:
                where = f"cuda:{device.index}"
                x, y = torch.as_tensor(x, device=where), torch.as_tensor(y, device=where)
            speed, _ = solo_speed(model, x, y, None, min_seconds=float(cfg.get("min_seconds", 0.5)))
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows.append({"batch": size, "fits": False, "reason": "CUDA out of memory"})
            break
        memory = torch.cuda.max_memory_allocated(device.index) if device.is_cuda else _peak_rss()
        fits = budget is None or memory <= budget
        rows.append({"batch": size, "samples_per_second": speed, "memory": memory, "fits": fits,
                     **({} if fits else {"reason": "over the memory budget"})})
        if not fits:
            break
    Path(cfg["out"]).write_text(json.dumps({
        "device": device.spec, "label": device.label, "rows": rows, "signature": model_signature(model),
    }))


if __name__ == "__main__":
    _worker(json.loads(Path(sys.argv[1]).read_text()))
