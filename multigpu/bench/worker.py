"""The per-rank program of a benchmark run: ``python -m multigpu.bench.worker CONFIG.json``.

Started by :func:`multigpu.bench.runs.run_config` (through the supervisor for
several devices); never by hand in normal use.  Trains the configured model on
synthetic data of its input shape and writes rank 0's result to ``out``.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

__all__ = ["main"]

from multigpu import env
from multigpu.bench.clock import timer as _timer
from multigpu.bench.clock import write as _write


def _baselines(cfg: dict) -> dict:
    """The baselines' programs, from the checkout's ``benchmarks/baselines.py`` (for a baseline's run only)."""
    if "baselines" not in cfg:
        return {}
    import importlib.util

    spec = importlib.util.spec_from_file_location("multigpu_benchmark_baselines", cfg["baselines"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BASELINES


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return 0


def _await_turn(cfg: dict) -> None:
    """Under :func:`multigpu.bench.runs.run_in_turn` (``turn``): says this process is ready, then waits for its
    turn to measure."""
    turn = cfg.get("turn")
    if not turn:
        return
    Path(turn + ".ready").touch()
    while not Path(turn + ".go").exists():
        time.sleep(0.005)


def _fit_run(cfg: dict, spec) -> None:
    """``multigpu``, ``solo`` and ``single``: Keras ``fit`` with or without multigpu."""
    import keras

    import multigpu

    batch, steps, warmup = int(cfg["batch"]), int(cfg["steps"]), int(cfg.get("warmup", 2))
    mode = cfg["mode"]
    if mode == "single" and keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(max(1, len(cfg.get("cores") or [0])))
    model = spec.build(float(cfg.get("width", 1.0)))
    parallel = None
    if mode in ("multigpu", "solo"):
        kwargs = {"compression": cfg.get("compression"), "sync_batchnorm": bool(cfg.get("sync_batchnorm")),
                  "shard_optimizer": cfg.get("shard_optimizer")}  # None: parallelize's default
        if cfg.get("ratios") == "auto":
            kwargs.update(recalibrate=True, profile=str(Path(cfg["out"]).with_suffix(".profile.json")))
        model = multigpu.parallelize(model, devices=cfg["devices"], ratios=cfg.get("ratios"), **kwargs)
        parallel = model if mode == "multigpu" else None
    spec.compile(model)
    epochs = max(1, int(cfg.get("epochs", 1)))  # the steps over this many epochs (a judgment needs two)
    x, y = spec.data(batch * max(1, (steps + warmup) // epochs), 0)
    phases = None
    if cfg.get("breakdown"):
        from multigpu.bench import breakdown

        phases = breakdown.install(model)
    timer = _timer(batch, warmup, int(cfg.get("print_every", 0)), parallel, phases)
    _await_turn(cfg)
    callbacks = [timer]
    if cfg.get("sweep"):
        sweep = _sweep_callback(parallel, cfg["sweep"], warmup, int(cfg["window_steps"]))
        callbacks.insert(0, sweep)
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    if multigpu.rank() != 0:
        return
    rate = timer.rate()
    if cfg.get("sweep"):
        _write(cfg, {"sweep": sweep.rates(timer.times, batch), "samples_per_second": rate})
        return
    timed = timer.times[warmup:]
    result = {"samples_per_second": rate, "loss": timer.loss, "time_per_step": batch / rate,
              "peak_rss": _peak_rss(), "step_times": [b - a for a, b in itertools.pairwise(timed)]}
    if phases is not None:
        result["breakdown"] = phases.per_step_ms(timed[-1] - timed[0])
    if parallel is not None:
        st = multigpu.state(model)
        result.update(ratios=st.ratios, shares=st.shares(batch), devices=[d.label for d in st.devices],
                      report=st.last_report, transport=st.transport, overlap=st.overlap, aside=st.aside,
                      judgment=st.judgment)
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
    _await_turn(cfg)
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


def _tensorflow_threads(cfg: dict) -> None:
    """Before TensorFlow starts: one op thread per core (TensorFlow counts the machine's cores, not this process's),
    and for ``tf-mirrored`` one logical CPU device per listed device."""
    import tensorflow as tf

    cores = len(cfg.get("cores") or [0])
    tf.config.threading.set_intra_op_parallelism_threads(cores if cfg["mode"] == "single" else 1)
    tf.config.threading.set_inter_op_parallelism_threads(cores)
    if cfg["mode"] == "tf-mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in cfg["devices"]])


class _NoTensorFlow:
    available = False


def set_random_seed(seed: int) -> None:
    """``keras.utils.set_random_seed`` as it runs where TensorFlow is not installed, unless TensorFlow is imported
    (its backend): Keras's own imports TensorFlow wherever it is installed, to seed ``tf.data``, which no run
    here reads (2 s of a worker's start on torch and JAX, and TensorFlow's start-up lines; the test scripts seed
    with it too, ``tests/scripts/seeding.py``)."""
    import keras

    try:
        from keras.src.utils import rng_utils
    except ImportError:  # a Keras that moved it: its own function
        rng_utils = None
    if rng_utils is None or not hasattr(rng_utils, "tf") or "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    kept, rng_utils.tf = rng_utils.tf, _NoTensorFlow()
    try:
        keras.utils.set_random_seed(seed)
    finally:
        rng_utils.tf = kept


def main(path: str) -> None:
    """Runs the configuration in ``path``."""
    env.set_default("KERAS_BACKEND", "torch")
    cfg = json.loads(Path(path).read_text())
    if cfg["mode"] == "keras-dp":  # before JAX starts: one XLA host device per planned device
        env.put("XLA_FLAGS", (env.get("XLA_FLAGS", "") +
                              f" --xla_force_host_platform_device_count={len(cfg['devices'])}").strip())
    if env.get("KERAS_BACKEND") == "tensorflow" and cfg["mode"] in ("single", "tf-mirrored"):
        _tensorflow_threads(cfg)

    from multigpu.bench.models import get_model

    set_random_seed(int(cfg.get("seed", 0)))
    spec = get_model(cfg["model"])
    runs = {"calibrate": _calibrate_run, **_baselines(cfg)}
    runs.get(cfg["mode"], _fit_run)(cfg, spec)


if __name__ == "__main__":
    main(sys.argv[1])
