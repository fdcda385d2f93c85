"""The per-rank program of a benchmark run: ``python -m multigpu.bench.worker CONFIG.json``.

Started by :func:`multigpu.bench.runs.run_config` (through the supervisor for
several devices); never by hand in normal use.  Trains the configured model on
synthetic data of its input shape and writes rank 0's result to ``out``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _timer(batch: int, warmup: int, print_every: int, parallel_model=None, breakdown=None):
    import keras

    class Timer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.samples = 0
            self.loss = float("nan")
            self.next_print = print_every

        def on_train_batch_end(self, step, logs=None):
            self.times.append(time.perf_counter())
            if breakdown is not None and len(self.times) == warmup + 1:
                breakdown.reset()  # the phases of the timed steps only
            self.samples += batch
            self.loss = float((logs or {}).get("loss", float("nan")))
            if print_every and self.samples >= self.next_print and len(self.times) > warmup + 1:
                self.next_print += print_every
                _progress(self.samples, batch, self.rate(), parallel_model)

        def rate(self) -> float:
            timed = self.times[warmup:]
            if len(timed) < 2:
                return float("nan")
            return batch * (len(timed) - 1) / (timed[-1] - timed[0])

    return Timer()


def _progress(samples: int, batch: int, total_rate: float, model) -> None:
    import multigpu

    if multigpu.rank() != 0:
        return
    print(f"After {samples} samples", flush=True)
    if model is not None:
        st = multigpu.state(model)
        for dev, share in zip(st.devices, st.shares(batch)):
            print(f"{dev.label}[{share}] {total_rate * share / batch:.0f} sps", flush=True)
    print(f"Total:[{batch}] {total_rate:.0f} sps", flush=True)


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return 0


def _write(cfg: dict, result: dict) -> None:
    Path(cfg["out"]).write_text(json.dumps({"mode": cfg["mode"], "config": cfg, **result}))


def _fit_run(cfg: dict, spec) -> None:
    """``multigpu``, ``solo`` and ``single``: Keras ``fit`` with or without multigpu."""
    import torch

    import multigpu

    batch, steps, warmup = int(cfg["batch"]), int(cfg["steps"]), int(cfg.get("warmup", 2))
    mode = cfg["mode"]
    if mode == "single":
        torch.set_num_threads(max(1, len(cfg.get("cores") or [0])))
    model = spec.build(float(cfg.get("width", 1.0)))
    parallel = None
    if mode in ("multigpu", "solo"):
        kwargs = {"compression": cfg.get("compression"), "sync_batchnorm": bool(cfg.get("sync_batchnorm"))}
        if cfg.get("ratios") == "auto":
            kwargs.update(recalibrate=True, profile=str(Path(cfg["out"]).with_suffix(".profile.json")))
        model = multigpu.parallelize(model, devices=cfg["devices"], ratios=cfg.get("ratios"), **kwargs)
        parallel = model if mode == "multigpu" else None
    spec.compile(model)
    x, y = spec.data(batch * (steps + warmup), 0)
    phases = None
    if cfg.get("breakdown"):
        from multigpu.bench import breakdown

        phases = breakdown.install(model)
    timer = _timer(batch, warmup, int(cfg.get("print_every", 0)), parallel, phases)
    callbacks = [timer]
    if cfg.get("sweep"):
        sweep = _sweep_callback(parallel, cfg["sweep"], warmup, int(cfg["window_steps"]))
        callbacks.insert(0, sweep)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    if multigpu.rank() != 0:
        return
    rate = timer.rate()
    if cfg.get("sweep"):
        _write(cfg, {"sweep": sweep.rates(timer.times, batch), "samples_per_second": rate})
        return
    result = {"samples_per_second": rate, "loss": timer.loss, "time_per_step": batch / rate,
              "peak_rss": _peak_rss()}
    if phases is not None:
        timed = timer.times[warmup:]
        result["breakdown"] = phases.per_step_ms(timed[-1] - timed[0])
    if parallel is not None:
        st = multigpu.state(model)
        result.update(ratios=st.ratios, shares=st.shares(batch), devices=[d.label for d in st.devices],
                      report=st.last_report, transport=st.transport)
    _write(cfg, result)


_SETTLE = 2  # steps after a change of shares whose rows were planned before it (the plan queue holds two)


def _sweep_schedule(shares: list[float], warmup: int, window: int) -> list[tuple[int, float]]:
    """``(step, share)``: from the end of ``step`` on, the fast device's share is ``share``."""
    return [(warmup - 1 + i * (_SETTLE + window), share) for i, share in enumerate(shares)]


def _sweep_callback(parallel, shares: list[float], warmup: int, window: int):
    """A callback that moves fixed shares at step boundaries, the same steps on every rank.

    The fast device's share goes through ``shares`` in order, each for
    ``_SETTLE + window`` steps after ``warmup`` untimed steps; ``rates``
    gives the samples/s of each window (the steps after the settling ones), so every
    point of a grid is timed in one warm process, interleaved with the others.
    """
    import keras

    from multigpu.keras.parallel import _MODELS

    balancer = _MODELS[parallel].balancer
    schedule = dict(_sweep_schedule(shares, warmup, window))

    class Sweep(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            share = schedule.get(step)
            if share is not None:
                balancer.ratios = [share, 1.0 - share]

        def rates(self, times: list[float], batch: int) -> list[list[float]]:
            out = []
            for step, share in _sweep_schedule(shares, warmup, window):
                begin = step + _SETTLE  # times[i] is the end of step i
                if begin + window < len(times):
                    out.append([share, batch * window / (times[begin + window] - times[begin])])
            return out

    return Sweep()


def _torch_optimizer(model, params):
    import torch

    name = type(model.optimizer).__name__.lower()
    make = {"rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3), "adam": lambda: torch.optim.Adam(params, lr=1e-3)}
    return make.get(name, lambda: torch.optim.SGD(params, lr=1e-2))()


def _ddp_run(cfg: dict, spec) -> None:
    """PyTorch DDP with its own loop and a torch optimizer, equal shares."""
    import keras
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from multigpu.planning.shares import split
    from multigpu.runtime import start

    runtime = start(cfg["devices"], 120.0)  # binds this rank and joins the group
    batch, steps, warmup = int(cfg["batch"]), int(cfg["steps"]), int(cfg.get("warmup", 2))
    model = spec.build(float(cfg.get("width", 1.0)))
    spec.compile(model)  # for the loss; the loop uses a torch optimizer
    x, y = spec.data(batch * (steps + warmup), 0)
    model(x[:1])
    ddp = DistributedDataParallel(model) if runtime.world_size > 1 else model
    optimizer = _torch_optimizer(model, [p for p in model.parameters() if p.requires_grad])
    loss_fn = model.loss if callable(model.loss) else keras.losses.get(model.loss)
    local = split(batch, [1.0] * runtime.world_size)
    begin = sum(local[: runtime.rank])
    times, loss = [], float("nan")
    for step in range(steps + warmup):
        start_row = step * batch + begin
        xb = torch.from_numpy(x[start_row : start_row + local[runtime.rank]])
        yb = torch.from_numpy(y[start_row : start_row + local[runtime.rank]])
        optimizer.zero_grad()
        value = torch.mean(loss_fn(yb, ddp(xb, training=True)))
        value.backward()
        optimizer.step()
        loss = float(value.detach())
        times.append(time.perf_counter())
    if runtime.world_size > 1:
        dist.barrier()
    if runtime.rank == 0:
        timed = times[warmup:]
        rate = batch * (len(timed) - 1) / (timed[-1] - timed[0])
        _write(cfg, {"samples_per_second": rate, "loss": loss, "time_per_step": batch / rate, "shares": local})


def _keras_ddp_run(cfg: dict, spec) -> None:
    """Keras ``fit`` with the model's forward through DDP and metrics summed over ranks, equal shares.

    This is what Keras's torch trainer does by itself once a process group
    exists (from Keras 3.16): DDP's mean of the gradients, one all-reduce of
    the metric states per step.
    """
    import keras
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from multigpu.keras import _compat
    from multigpu.planning.shares import split
    from multigpu.runtime import start

    runtime = start(cfg["devices"], 120.0)
    batch, steps, warmup = int(cfg["batch"]), int(cfg["steps"]), int(cfg.get("warmup", 2))
    model = spec.build(float(cfg.get("width", 1.0)))
    spec.compile(model)
    x, y = spec.data(batch * (steps + warmup), 0)
    model(x[:1])
    ddp = DistributedDataParallel(model)
    local = split(batch, [1.0] * runtime.world_size)
    begin = sum(local[: runtime.rank])
    rows = [step * batch + begin + i for step in range(steps + warmup) for i in range(local[runtime.rank])]
    cls = type(model)

    def train_step(data):
        xb, yb, sw = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = ddp(xb, training=True)
        model.zero_grad()
        loss = _compat.compute_loss(model, xb, yb, y_pred, sw, training=True)
        _compat.loss_tracker(model).update_state(loss, sample_weight=xb.shape[0])
        loss.backward()
        trainable = model.trainable_weights[:]
        with torch.no_grad():
            model.optimizer.apply([v.value.grad for v in trainable], trainable)
        return model.compute_metrics(xb, yb, y_pred, sample_weight=sw)

    def get_metrics_result():
        variables = [v for m in model.metrics for v in m.variables]
        saved = [v.value.detach().clone() for v in variables]
        for v in variables:
            dist.all_reduce(v.value.data)
        try:
            return cls.get_metrics_result(model)
        finally:
            with torch.no_grad():
                for v, s in zip(variables, saved):
                    v.value.copy_(s)

    object.__setattr__(model, "train_step", train_step)
    object.__setattr__(model, "get_metrics_result", get_metrics_result)
    timer = _timer(batch, warmup, 0)
    model.fit(x[rows], y[rows], batch_size=local[runtime.rank], epochs=1, shuffle=False, verbose=0,
              callbacks=[timer])
    dist.barrier()
    if runtime.rank == 0:
        rate = timer.rate()
        _write(cfg, {"samples_per_second": rate, "loss": timer.loss, "time_per_step": batch / rate, "shares": local})


def _calibrate_run(cfg: dict, spec) -> None:
    """Solo samples/s at each batch size, up to the largest that fits."""
    import keras
    import torch

    import multigpu
    from multigpu.balancing.profiles import model_signature

    model = spec.build(float(cfg.get("width", 1.0)))
    model = multigpu.parallelize(model, devices=cfg["devices"], ratios=None)
    spec.compile(model)
    device = multigpu.state(model).devices[0]
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
            speed = _solo_rate(model, keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y),
                               float(cfg.get("min_seconds", 0.5)))
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
    _write(cfg, {"device": device.spec, "label": device.label, "rows": rows, "signature": model_signature(model)})


def _passes(model):
    """One forward and backward pass of ``model`` on ``(x, y)``, finished when it returns (either backend)."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        def loss(trainable, non_trainable, metrics, optimizer, x, y):
            return model.compute_loss_and_updates(trainable, non_trainable, metrics, x, y, None, training=True,
                                                  optimizer_variables=optimizer)[0]

        grads = jax.jit(jax.grad(loss))

        def run(x, y):
            jax.block_until_ready(grads([v.value for v in model.trainable_variables],
                                        [v.value for v in model.non_trainable_variables],
                                        [v.value for v in model.metrics_variables],
                                        [v.value for v in model.optimizer.variables], x, y))
        return run

    def run(x, y):
        model.zero_grad()
        model.compute_loss(x=x, y=y, y_pred=model(x, training=True), training=True).backward()
    return run


def _solo_rate(model, x, y, min_seconds: float) -> float:
    """Samples/s of forward and backward passes (no optimizer), after one warm-up pass (JAX: the compilation)."""
    timed, rows = [], int(x.shape[0])
    passes = _passes(model)
    for i in range(31):
        t0 = time.perf_counter()
        passes(x, y)
        if i:
            timed.append(time.perf_counter() - t0)
        if len(timed) >= 2 and sum(timed) >= min_seconds:
            break
    return rows * len(timed) / sum(timed)


def _keras_dp_run(cfg: dict, spec) -> None:
    """Keras's own ``keras.distribution.DataParallel`` on JAX: one process, its CPU split into
    ``len(devices)`` XLA host devices, equal shares.  ``capacity`` (cores' worth of CPU time, e.g. 1.5 for a
    full core beside a half one) caps the process with a cgroup quota."""
    import jax
    import keras

    if cfg.get("capacity"):
        from multigpu.throttle import CpuQuota

        cores = len(cfg.get("cores") or [0])
        CpuQuota(float(cfg["capacity"]) / cores, cores).apply()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices("cpu")))
    batch, steps, warmup = int(cfg["batch"]), int(cfg["steps"]), int(cfg.get("warmup", 2))
    model = spec.build(float(cfg.get("width", 1.0)))
    spec.compile(model)
    x, y = spec.data(batch * (steps + warmup), 0)
    timer = _timer(batch, warmup, 0)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    rate = timer.rate()
    _write(cfg, {"samples_per_second": rate, "loss": timer.loss, "time_per_step": batch / rate,
                 "devices": [str(d) for d in jax.devices("cpu")]})


def _keras_dp_procs_run(cfg: dict, spec) -> None:
    """Keras's own ``keras.distribution.DataParallel`` on JAX over the run's processes, one device each
    (the devices' speeds applied as for multigpu: ``cpu:1@0.5`` runs under half a core), equal shares: each
    process feeds its half of every global batch, as Keras's multi-process data parallelism asks."""
    import jax
    import keras
    import numpy as np

    rank, n = jax.process_index(), jax.process_count()
    distribution = keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False)
    keras.distribution.set_distribution(distribution)  # each process feeds its own rows
    batch, steps, warmup = int(cfg["batch"]), int(cfg["steps"]), int(cfg.get("warmup", 2))
    if batch % n:
        raise ValueError(f"keras-dp-procs splits every batch equally over {n} processes: the batch must divide by "
                         f"{n}. Received: batch={batch}")
    local = batch // n
    model = spec.build(float(cfg.get("width", 1.0)))
    spec.compile(model)
    x, y = spec.data(batch * (steps + warmup), 0)
    rows = np.concatenate([np.arange(s * batch + rank * local, s * batch + (rank + 1) * local)
                           for s in range(steps + warmup)])
    timer = _timer(batch, warmup, 0)
    model.fit(x[rows], y[rows], batch_size=local, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    if rank == 0:
        rate = timer.rate()
        _write(cfg, {"samples_per_second": rate, "loss": timer.loss, "time_per_step": batch / rate,
                     "devices": [str(d) for d in jax.devices()]})


def main(path: str) -> None:
    """Runs the configuration in ``path``."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    cfg = json.loads(Path(path).read_text())
    if cfg["mode"] == "keras-dp":  # before JAX starts: one XLA host device per planned device
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={len(cfg['devices'])}").strip()
    import keras

    from multigpu.bench.models import get_model

    keras.utils.set_random_seed(int(cfg.get("seed", 0)))
    spec = get_model(cfg["model"])
    runs = {"calibrate": _calibrate_run, "ddp": _ddp_run, "keras-ddp": _keras_ddp_run, "keras-dp": _keras_dp_run,
            "keras-dp-procs": _keras_dp_procs_run}
    runs.get(cfg["mode"], _fit_run)(cfg, spec)


if __name__ == "__main__":
    main(sys.argv[1])
