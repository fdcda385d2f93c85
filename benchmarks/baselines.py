"""The baselines a benchmark compares multigpu with, each one rank's program (see :mod:`multigpu.bench.runs`).

Laboratory code, kept out of the installed package: ``multigpu bench --baseline`` and the benchmarks load
this file from the checkout (:func:`multigpu.bench.runs.baselines_file`).

All of them split every global batch equally, each rank feeding its own slice.
``keras-ddp`` emulates on any Keras what ``keras-fit-ddp`` runs for real on
Keras 3.16 and newer: Keras's own torch trainer wrapping the model in DDP
once a process group is up.  ``tf-mirrored`` is Keras's own ``fit`` under
``tf.distribute.MirroredStrategy`` on the TensorFlow backend.
"""

from __future__ import annotations

import time

from multigpu.bench.clock import timer as _timer
from multigpu.bench.clock import write as _write

__all__ = ["BASELINES"]


def _torch_optimizer(model, params):
    import torch

    name = type(model.optimizer).__name__.lower()
    make = {"rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3), "adam": lambda: torch.optim.Adam(params, lr=1e-3)}
    return make.get(name, lambda: torch.optim.SGD(params, lr=1e-2))()


def _compress_hook(dtype):
    """DDP's ``bf16_compress_hook``/``fp16_compress_hook``, step for step, for any backend.

    torch's own bf16 hook refuses to register without CUDA and NCCL; gloo sums
    16-bit tensors on CPUs, so this one runs the same steps there: each
    bucket divided by the world size, cast, summed, cast back.
    """
    import torch.distributed as dist

    def compress_hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(decompress)

    return compress_hook


def _ddp_run(cfg: dict, spec) -> None:
    """PyTorch DDP with its own loop and a torch optimizer, equal shares (``compression``: DDP's 16-bit hooks)."""
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
    if cfg.get("compression") and runtime.world_size > 1:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg["compression"]]
        ddp.register_comm_hook(None, _compress_hook(dtype))
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

    from multigpu._keras import compat as _compat
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
    model = spec.build(float(cfg.get("width", 1.0)))
    spec.compile(model)
    _fit_whole_batches(cfg, spec, model, devices=[str(d) for d in jax.devices("cpu")])


def _fit_whole_batches(cfg: dict, spec, model, **extra) -> None:
    """One process's Keras ``fit`` on the global batches (a distribution or strategy splits them), timed."""
    batch, steps, warmup = int(cfg["batch"]), int(cfg["steps"]), int(cfg.get("warmup", 2))
    x, y = spec.data(batch * (steps + warmup), 0)
    timer = _timer(batch, warmup, 0)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    rate = timer.rate()
    _write(cfg, {"samples_per_second": rate, "loss": timer.loss, "time_per_step": batch / rate, **extra})


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



def _keras_fit_ddp_run(cfg: dict, spec) -> None:
    """Keras's own ``fit`` under a torch process group (Keras 3.16 and newer): its torch trainer wraps the model in
    DDP and all-reduces the metric states itself; each rank fits its own slice of every global batch."""
    import keras
    import torch.distributed as dist

    from multigpu._keras import compat as _compat
    from multigpu.planning.shares import split
    from multigpu.runtime import start

    if _compat.keras_version() < (3, 16):
        raise RuntimeError("keras-fit-ddp runs Keras's own DDP fit, which Keras 3.16 brought; this is Keras "
                           f"{keras.__version__}. Use keras-ddp (the same loop, written out) on older Keras.")
    runtime = start(cfg["devices"], 120.0)
    batch, steps, warmup = int(cfg["batch"]), int(cfg["steps"]), int(cfg.get("warmup", 2))
    model = spec.build(float(cfg.get("width", 1.0)))
    spec.compile(model)
    x, y = spec.data(batch * (steps + warmup), 0)
    local = split(batch, [1.0] * runtime.world_size)
    begin = sum(local[: runtime.rank])
    rows = [step * batch + begin + i for step in range(steps + warmup) for i in range(local[runtime.rank])]
    clock = _timer(batch, warmup, 0)
    model.fit(x[rows], y[rows], batch_size=local[runtime.rank], epochs=1, shuffle=False, verbose=0,
              callbacks=[clock])
    if getattr(model, "ddp_model", None) is None:
        raise RuntimeError("Keras's fit did not wrap the model in DDP: not the baseline this mode measures")
    dist.barrier()
    if runtime.rank == 0:
        rate = clock.rate()
        _write(cfg, {"samples_per_second": rate, "loss": clock.loss, "time_per_step": batch / rate, "shares": local})


def _tf_mirrored_run(cfg: dict, spec) -> None:
    """Keras ``fit`` under ``tf.distribute.MirroredStrategy`` (TensorFlow): one process on the listed devices' cores,
    one logical CPU device per listed device (made by :func:`multigpu.bench.worker.main` before TensorFlow starts),
    equal halves of every batch; the one multi-device path Keras 3 has on TensorFlow."""
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    with tf.distribute.MirroredStrategy(devices).scope():
        model = spec.build(float(cfg.get("width", 1.0)))
        spec.compile(model)
    _fit_whole_batches(cfg, spec, model, devices=devices)


BASELINES = {"ddp": _ddp_run, "keras-ddp": _keras_ddp_run, "keras-fit-ddp": _keras_fit_ddp_run,
             "keras-dp": _keras_dp_run, "keras-dp-procs": _keras_dp_procs_run, "tf-mirrored": _tf_mirrored_run}
