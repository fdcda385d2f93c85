"""The CUDA path: a GPU and a CPU device in one run (real processes).

These tests need a CUDA GPU and are skipped (reported as skipped) on
machines without one, as CI's.  One GPU is enough: the GPU rank and the CPU
rank sum their gradients over gloo (NCCL needs every rank on a GPU of its
own).  TF32 is off (``NVIDIA_TF32_OVERRIDE=0``) so that the GPU computes in
float32 like the CPU, and the reference is plain Keras on the GPU.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import SCRIPTS
from tests.test_exactness import load, max_relative_error

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.cuda,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROWS = "193"
# Two kinds of processor round differently (cuDNN's GRU, cuBLAS's sums): float32 rounding, not 1e-5.
TOLERANCE = {"sgd": 1e-4, "adam": 1e-3}
F32 = {"NVIDIA_TF32_OVERRIDE": "0", "KERAS_TORCH_DEVICE": "cuda"}


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "plain.npz"
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", **F32}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    res = subprocess.run([sys.executable, str(SCRIPTS / "exactness.py"), str(out), "--plain", "--rows", ROWS],
                         capture_output=True, check=False, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return load(out)


@pytest.mark.parametrize("ratios", ["3,1", "1,3"])
def test_a_gpu_and_a_cpu_device_reproduce_one_gpu(runner, gpu_reference, ratios):
    # With 193 rows at batch 64 the last batch has one row: 3:1 leaves the CPU rank
    # without rows, 1:3 the GPU rank.
    out = runner.tmp_path / "par.npz"
    res = runner.cli("run", "--devices", "cuda:0,cpu:0", "--ratios", ratios, str(SCRIPTS / "exactness.py"),
                     str(out), "--devices", "cuda:0,cpu:0", "--rows", ROWS, timeout=240, extra_env=F32)
    assert res.returncode == 0, res.stdout
    got = load(out)
    for name, tolerance in TOLERANCE.items():
        ref_weights, ref_history = gpu_reference[name]
        weights, history = got[name]
        assert max_relative_error(ref_weights, weights) <= tolerance, name
        np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=tolerance)
    other = load(f"{out}.rank1.npz")
    for name in TOLERANCE:
        assert max_relative_error(got[name][0], other[name][0]) == 0.0
    assert runner.leftovers() == []


def test_each_rank_computes_on_its_own_device(runner):
    code = (
        "import keras, multigpu, torch\n"
        "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])\n"
        "m = multigpu.parallelize(m, devices=['cuda:0', 'cpu:0'])\n"
        "m.compile('sgd', 'mse')\n"
        "import numpy as np\n"
        "m.fit(np.ones((8, 4), 'float32'), np.ones((8, 2), 'float32'), batch_size=8, verbose=0)\n"
        "print(f'rank {multigpu.rank()} on', m.weights[0].value.device.type, flush=True)\n"
    )
    script = runner.tmp_path / "where.py"
    script.write_text(code)
    res = runner.run([sys.executable, str(script)], timeout=180)
    assert res.returncode == 0, res.stdout
    assert "rank 0 on cuda" in res.stdout and "rank 1 on cpu" in res.stdout, res.stdout
    assert runner.leftovers() == []


def test_a_real_cuda_out_of_memory_is_cut_again_and_stays_exact(runner, tmp_path):
    """The GPU rank's allocator held to 160 MiB (which its free memory does not show) with automatic shares, a
    global batch of 16384, then 32768: torch
    raises its OutOfMemoryError, every rank leaves the step, the GPU's cap is lowered and the step taken again;
    the weights equal one device's (the CPU rank's reference) to float32 rounding across processors."""
    out = tmp_path / "out.json"
    result = runner.script("memory_caps.py", "cuda:0,cpu:0", "auto", str(out), "--batch", "16384",
                           "--gpu-mib", "160", timeout=280, extra_env=F32)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "out of memory on GPU:0 at" in result.stdout, result.stdout[-3000:]
    import json

    assert json.loads(out.read_text())["error"] < TOLERANCE["sgd"]


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "weights"])
def test_a_sharded_optimizer_on_a_gpu_and_a_cpu_device_matches_one_gpu(runner, shard):
    """The optimizer state in parts with a GPU rank beside a CPU rank (the weights gathered over gloo, the state
    in CUDA and CPU tensors), with ``shard="gradients"`` the GPU rank's gradients written into the sum's
    buffer and not kept, and with ``shard="weights"`` each layer's weights gathered in CUDA and CPU tensors for
    its passes (the EMA refused): every optimizer feature, against plain Keras on the GPU."""
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", **F32}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    plain = subprocess.run([sys.executable, str(SCRIPTS / "sharded.py"), "features", str(runner.tmp_path / "plain"),
                            "--plain"], capture_output=True, check=False, text=True, timeout=240, env=env,
                           cwd=runner.tmp_path)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    res = runner.run([sys.executable, str(SCRIPTS / "sharded.py"), "features", str(runner.tmp_path / "par"),
                      "--devices", "cuda:0,cpu:0", "--ratios", "3,1", "--shard", shard], timeout=240,
                     extra_env=F32)
    assert res.returncode == 0, res.stdout
    with np.load(runner.tmp_path / "plain-features.npz") as p, np.load(runner.tmp_path / "par-features.npz") as g:
        names = [k.split(".")[0] for k in p.files if k.endswith(".weights")]
        assert len(names) == 11
        if shard == "weights":
            assert "cannot take an optimizer with `use_ema=True`" in str(g["ema.refused"])
            names.remove("ema")
        for name in names:
            tolerance = {"mixed_float16": 1e-2, "mixed_bfloat16": 5e-2}.get(name, 1e-3)
            assert max_relative_error([p[f"{name}.weights"]], [g[f"{name}.weights"]]) <= tolerance, name
            assert max_relative_error([p[f"{name}.state"]], [g[f"{name}.state"]]) <= tolerance, name
            assert int(g[f"{name}.held"]) < int(p[f"{name}.held"]), name
            assert (int(g[f"{name}.gradients_kept"]) == 0) == (shard in ("gradients", "weights")), name


def _sees_a_gpu(backend: str) -> bool:
    """Whether this machine's build of ``backend`` computes on a GPU (its CUDA build is installed)."""
    probe = {"tensorflow": "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))",
             "jax": "import jax; print(len([d for d in jax.devices() if d.platform == 'gpu']))"}[backend]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env,
                         check=False)
    return res.returncode == 0 and res.stdout.strip().splitlines()[-1:] not in ([], ["0"])


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_the_tensorflow_and_jax_gpu_paths_reproduce_one_gpu(runner, tmp_path, backend):
    """The same GPU rank beside a CPU rank at 3:1 on TensorFlow and on JAX, against plain Keras on the GPU in
    that backend; skipped (and reported) where the backend's CUDA build is not installed."""
    if not _sees_a_gpu(backend):
        pytest.skip(f"{backend}'s CUDA build is not installed here: its GPU path did not run")
    backend_env = {"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env = {**os.environ, "OMP_NUM_THREADS": "1", **F32, **backend_env}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    plain = tmp_path / "plain.npz"
    res = subprocess.run([sys.executable, str(SCRIPTS / "exactness.py"), str(plain), "--plain", "--rows", ROWS],
                         capture_output=True, check=False, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "par.npz"
    res = runner.cli("run", "--devices", "cuda:0,cpu:0", "--ratios", "3,1", str(SCRIPTS / "exactness.py"), str(out),
                     "--rows", ROWS, timeout=280, extra_env={**F32, **backend_env})
    assert res.returncode == 0, res.stdout[-3000:]
    reference, got = load(plain), load(out)
    for name, tolerance in TOLERANCE.items():
        assert max_relative_error(reference[name][0], got[name][0]) <= tolerance, (backend, name)
    assert runner.leftovers() == []
