"""Shared helpers: run scripts in fresh processes with a hard timeout and
check that none of their processes is left behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests are judged by what they assert, not by how fast a loaded 2-core machine runs them.
settings.register_profile("multigpu", deadline=None)
settings.load_profile("multigpu")

os.environ.setdefault("KERAS_BACKEND", "torch")
# The suite tests CPU devices, as CI has them; on a machine with a GPU, Keras would put this
# process's tensors there and the scripts' plain references would run there (tests/test_cuda.py
# is the GPU's own suite).
os.environ.setdefault("KERAS_TORCH_DEVICE", "cpu")

SCRIPTS = Path(__file__).parent / "scripts"

# Cases that `make test` leaves to `make test-outside` (and `make test-launchers`) to stay within 12 minutes; each
# is the second backend or the second ratio of a path that a sibling case checks in `make test`.
OUTSIDE = {
    "test_faults.py::test_below_min_devices_the_run_ends_naming_what_is_left[torch]":
        "min_devices checked and named in-process, and the survivors' runs on torch and TensorFlow, stay",
    "test_faults.py::test_inputs_read_once_per_machine_go_on_without_a_lost_rank[dataloader-1:forward:4-lost2-torch]":
        "the generator's schedule (a lost reader of input read once per machine) stays",
    "test_custom.py::test_custom_steps_match_one_device[cpu:0,cpu:1,cpu:2-1,2,5-shm]":
        "the same custom steps at 3:1 over gloo with overlap stay",
    "test_readme.py::test_pip_install_and_the_quickstart_in_a_fresh_environment":
        "a fresh environment installs torch and Keras (minutes); the quickstart from the checkout stays",
    "test_inputs.py::test_pandas_jax_and_tensorflow_arrays_reproduce_one_device_on_numpy[jax]":
        "the same conversion, before any backend's code, on torch stays",
    "test_inputs.py::test_pandas_jax_and_tensorflow_arrays_reproduce_one_device_on_numpy[tensorflow]":
        "the same conversion, before any backend's code, on torch stays",
    "test_tfdata.py::test_tf_data_pipelines_reproduce_one_device[jax-1,2,5]": "tf.data on JAX at 3:1 stays",
    "test_inputs.py::test_loaders_with_workers_reproduce_one_device[jax-1,2,5]": "loaders on torch stay",
    "test_jax.py::test_keras_features_on_jax": "the same features on torch (test_keras.py) and JAX's steps stay",
    "test_notebook.py::test_launch_at_3_to_1_in_a_kernel_reproduces_one_device[jax]": "the kernel on torch stays",
    "test_launchers.py::test_srun_over_two_nodes_is_one_run_equal_to_one_device[torch]": "srun on one node stays",
    "test_launchers.py::test_srun_over_two_nodes_is_one_run_equal_to_one_device[jax]": "srun on one node stays",
    "test_jax.py::test_a_custom_jax_train_step_matches_one_device[one_row_batches]": "the plain step stays",
    "test_jax.py::test_a_custom_jax_train_step_matches_one_device[sync_batchnorm]": "the plain step stays",
    "test_hub.py::test_keras_hub_tasks_reproduce_one_device[torch-3,1]": "torch at 1:2:5 stays",
    "test_cli.py::test_bench_prints_per_device_rates_baselines_and_breakdown": "the DDP baselines are laboratory",
    "test_tensorflow.py::test_mixed_model_matches_one_device[1,2,5-adam]": "3:1 and the optimizer features stay",
    "test_reliability.py::test_every_failure_ends_the_run_within_its_timeout[catch]": "the sleeping rank stays",
    "test_reliability.py::test_a_launcher_killed_with_sigkill_takes_its_ranks_with_it[torch]":
        "JAX's case, the same death signal to every rank, stays",
    "test_tfdata.py::test_tf_data_pipelines_reproduce_one_device[jax-3,1]": "tf.data on torch and JAX's steps stay",
    "test_jax.py::test_parallel_run_matches_single_device_on_jax[1,2,5-adam]": "3:1 with SGD and Adam stays",
    "test_jax.py::test_torchrun_two_machines_on_loopback_on_jax": "torchrun on torch stays",
    "test_tensorflow.py::test_torchrun_two_machines_on_loopback_on_tensorflow": "torchrun on torch stays",
    "test_tensorflow.py::test_a_rank_that_stops_answering_ends_the_tensorflow_run_within_the_timeout":
        "a killed rank on TensorFlow and the sleeping rank on torch stay",
    # `make test-launchers` runs every launcher case with a real slurmd and mpirun (installing them first); a fresh
    # machine has neither, so in `make test` they were reported as skipped there and ran only where installed
    "test_launchers.py::test_srun_runs_two_tasks_as_one_run_equal_to_one_device[torch]": "make test-launchers",
    "test_launchers.py::test_mpirun_runs_two_processes_as_one_run_equal_to_one_device[torch]": "make test-launchers",
    "test_launchers.py::test_srun_runs_two_tasks_as_one_run_equal_to_one_device[jax]": "make test-launchers",
    "test_launchers.py::test_mpirun_runs_two_processes_as_one_run_equal_to_one_device[jax]": "make test-launchers",
    "test_launch.py::test_an_exception_on_a_rank_ends_the_run_naming_it[1-fit-python]":
        "the exception at parallelize under multigpu run stays",
    "test_tfdata.py::test_tf_data_pipelines_reproduce_one_device[torch-1,2,5]": "tf.data at 3:1 stays",
    "test_reliability.py::test_interrupting_the_launching_process_stops_every_rank[15-python]":
        "SIGINT to multigpu run stays",
    "test_notebook.py::test_the_stop_button_stops_every_rank_and_raises_keyboard_interrupt":
        "a rank's error in the kernel, and SIGINT to a run (test_reliability.py), stay",
    "test_applications.py::test_mobilenet_v3_small_reproduces_one_device_at_1_2_5":
        "keras-hub's tasks built from a config (test_hub.py) stay as the outside models",
    "test_memory.py::test_a_global_batch_no_device_set_can_hold_ends_the_run_naming_the_caps":
        "the fixed ratios a device cannot hold, the same step's other ending, stays",
    "test_notebook.py::test_a_killed_kernel_leaves_no_process_behind": "the stop button and a rank's error stay",
    "test_faults.py::test_the_survivors_finish_every_epoch_exactly[sum-reached-one-save-rank0-gloo]":
        "the silent rank and the own step's schedules stay (gloo: test_links.py's two hosts)",
    "test_launch.py::test_torchrun_two_machines_on_loopback_match_one_machine":
        "two machines over a shaped link (test_links.py) stay",
    "test_faults.py::test_inputs_read_once_per_machine_go_on_without_a_lost_rank[pydataset-0:forward:4-lost0-torch]":
        "the generator's schedule stays",
    "test_faults.py::test_the_survivors_finish_every_epoch_exactly[silent-sum]":
        "the killed schedules and the own step's stay",
    "test_hub.py::test_keras_hub_tasks_reproduce_one_device[torch-1,2,5]":
        "keras-hub's tasks at 3:1 stay",
    "test_sharding.py::test_a_sharded_optimizer_matches_one_device[torch-cpu:0,cpu:1,cpu:2-1,2,5-gloo-weights]":
        "the weights in parts at 3:1 over shared memory stay",
    "test_sharding.py::test_a_sharded_optimizer_matches_one_device[torch-cpu:0,cpu:1,cpu:2-1,2,5-gloo-gradients]":
        "the optimizer in parts at 3:1 over shared memory stays",
    "test_sharding.py::test_a_sharded_optimizer_matches_one_device[torch-cpu:0,cpu:1-3,1-auto-gradients]":
        "the weights in parts at 3:1 (the gradients' level and more) stay; the gradients' level by default there",
    "test_sharding.py::test_a_sharded_optimizer_matches_one_device[tensorflow-cpu:0,cpu:1,cpu:2-1,2,5-gloo-optimizer]":
        "the optimizer in parts at 3:1 over shared memory stays",
    "test_sharding.py::test_a_sharded_optimizer_matches_one_device[jax-cpu:0,cpu:1,cpu:2-1,2,5-gloo-optimizer]":
        "the optimizer in parts on torch and TensorFlow stays",
    "test_sharding.py::test_a_sharded_optimizer_matches_one_device[jax-cpu:0,cpu:1-3,1-auto-optimizer]":
        "the optimizer in parts on torch and TensorFlow, through the same neutral code, stays",
    "test_notebook.py::test_launch_at_3_to_1_in_a_kernel_reproduces_one_device[torch]":
        "a launch in a kernel whose rank fails (the kernel stays usable) stays",
    "test_splits.py::test_every_split_of_a_batch_of_64_reproduces_one_device[torch]":
        "the 49 splits on each backend (a minute or two each); TensorFlow's uneven splits step by step stay",
    "test_splits.py::test_every_split_of_a_batch_of_64_reproduces_one_device[jax]":
        "the 49 splits on each backend (a minute or two each); TensorFlow's uneven splits step by step stay",
    "test_splits.py::test_every_split_of_a_batch_of_64_reproduces_one_device[tensorflow]":
        "the 49 splits on each backend (a minute or two each); TensorFlow's uneven splits step by step stay",
    "test_sharding.py::test_a_sharded_optimizer_matches_one_device[tensorflow-cpu:0,cpu:1-3,1-auto-optimizer]":
        "the optimizer in parts on torch, through the same neutral code (backend/sharding.py), stays",
    "test_inputs.py::test_loaders_with_workers_reproduce_one_device[jax-3,1]":
        "loaders with workers on torch stay (the data path is neutral)",
    "test_recipes.py::test_mixed_precision_steps_equal_one_devices_to_float16_rounding":
        "gradient accumulation and TensorBoard from the same example stay; mixed precision runs in test_sharding",
    "test_exactness.py::test_parallel_run_matches_single_device[1,2,5-shm]":
        "3:1 over shared memory and 1:3 over gloo stay; three devices stay through tf.data and loaders at 1:2:5",
    "test_reliability.py::test_every_failure_ends_the_run_within_its_timeout[sleep]":
        "a rank that never reaches the collective ends the run within its timeout in the catch case, which stays",
    "test_collectives.py::test_sums_over_part_of_the_ranks_then_over_every_rank[jax-shm]":
        "the engine's sums over part of the ranks through shared memory (the same segment code) stay",
    "test_balancing_run.py::test_devices_left_together_sum_among_themselves_and_the_result_stays_one_devices"
    "[tensorflow-left1]":
        "two devices left summing among themselves on torch stay (the moves are neutral; TensorFlow's sums are the "
        "engine's, whose subgroups test_collectives checks)",
    "test_balancing_run.py::test_devices_left_together_sum_among_themselves_and_the_result_stays_one_devices"
    "[jax-left2]":
        "two devices left summing among themselves on torch stay; JAX's sums over part of the ranks through shared "
        "memory stay in test_collectives",
    "test_memory.py::test_a_convnet_on_a_device_with_little_memory_at_batch_b_then_2b_equals_one_device"
    "[tensorflow-384MiB]":
        "the same caps and out-of-memory steps through the neutral step driver on torch stay",
    "test_memory.py::test_a_convnet_on_a_device_with_little_memory_at_batch_b_then_2b_equals_one_device"
    "[torch-160MiB]":
        "a model's own step out of memory taken again (torch, TensorFlow), the fixed ratios a device cannot hold "
        "and the weights in parts under a device's cap stay",
    "test_sharding.py::test_a_sharded_optimizer_matches_one_device[torch-cpu:0,cpu:1-3,1-auto-weights]":
        "the weights in parts under a device's cap (test_memory) stay",
    "test_cli.py::test_a_programs_logging_configuration_receives_multigpus_messages":
        "the logger's level in-process and the run's log level reaching the ranks stay",
    "test_tensorflow.py::test_a_killed_rank_ends_the_tensorflow_run_naming_it":
        "kill -9 of a rank on torch (the same torch.distributed engine), JAX's killed rank and TensorFlow's survivors "
        "of a killed rank (test_faults) stay",
    "test_exactness.py::test_compression_sends_16_bits_over_either_transport_and_stays_close[shm]":
        "compression over gloo (16-bit buckets during the backward pass, the same rounding as before shared memory) "
        "stays",
    "test_inputs.py::test_loaders_with_workers_reproduce_one_device[torch-3,1]":
        "loaders with workers at 1:2:5 (three devices on two cores) and 3:1 through tf.data stay",
}
# A device set aside and taken back: one case stays (TensorFlow, CPU:1 kept, measured again mid-fit, which makes
# every move of multigpu/backend/parking.py, the same code on every backend), with torch's two devices left
# together (test_devices_left_together_...) and JAX's sums among part of the ranks (test_collectives.py).
OUTSIDE.update({
    f"test_balancing_run.py::test_a_device_set_aside_and_taken_back_leaves_the_result_one_devices[{case}]":
        "TensorFlow's case measured again mid-fit stays (the moves are the same code on every backend)"
    for case in ("torch-0-False", "tensorflow-0-False", "jax-0-False", "torch-1-False", "tensorflow-1-False",
                 "jax-1-False", "torch-0-True", "tensorflow-0-True", "torch-1-True", "jax-1-True")})


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if item.nodeid.removeprefix("tests/") in OUTSIDE:
            item.add_marker(pytest.mark.outside)
REPO = Path(__file__).parent.parent


def processes_with_token(token: str) -> list[int]:
    """Pids of live processes whose environment carries ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z" and f"MULTIGPU_TEST_TOKEN={token}".encode() in environ:
            found.append(int(entry.name))
    return found


def _default_sigint() -> None:
    # A shell runs background jobs with SIGINT ignored, and children inherit
    # that; the interrupt tests need the default (KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Runner:
    """Runs commands with the test environment; kills them on timeout."""

    def __init__(self, tmp_path: Path, gpu: bool = False) -> None:
        self.tmp_path = tmp_path
        self.token = uuid.uuid4().hex
        self.gpu = gpu
        # The commands' temporary files (TensorFlow's autograph writes one per traced function and removes it
        # at exit, which a rank killed with SIGKILL never reaches) go to a folder of their own, removed after
        # the test; short, for the sockets that may be made there.
        self.tmp = tempfile.mkdtemp(prefix="mgt-")

    def env(self, extra: dict | None = None) -> dict:
        env = dict(os.environ)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        env.update(KERAS_BACKEND="torch", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   MULTIGPU_TEST_TOKEN=self.token, PYTHONWARNINGS="ignore", TMPDIR=self.tmp,
                   MULTIGPU_PROFILE=str(self.tmp_path / "profiles.json"))
        if not self.gpu:  # scripts see the machine CI has: no GPU
            env["CUDA_VISIBLE_DEVICES"] = ""
        for name, value in (extra or {}).items():  # None takes a variable out
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def start(self, args: list[str], extra_env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            args, env=self.env(extra_env), cwd=self.tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
            preexec_fn=_default_sigint,
        )

    def finish(self, proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"timed out after {timeout}s: {proc.args}\n{out[-3000:]}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def run(self, args: list[str], timeout: float = 120, extra_env: dict | None = None):
        return self.finish(self.start(args, extra_env), timeout)

    def together(self, *commands: tuple[list[str], dict | None], timeout: float = 120):
        """:func:`run_together` in this runner's environment and folder: ``(args, extra_env)`` each."""
        return run_together(*({"args": args, "env": self.env(extra), "cwd": self.tmp_path,
                               "preexec_fn": _default_sigint} for args, extra in commands), timeout=timeout)

    def script(self, name: str, *args: str, timeout: float = 120, extra_env: dict | None = None):
        return self.run([sys.executable, str(SCRIPTS / name), *args], timeout, extra_env)

    def ranks(self, devices: str, name: str, *args: str, timeout: float = 120, extra_env: dict | None = None):
        """``multigpu run --devices DEVICES`` of ``scripts/NAME ARGS``: its ranks, with no first process of the
        script's own (``python NAME`` imports Keras once more before its ``parallelize``: tests/test_launch.py,
        tests/test_reliability.py and the load-once tests run that path)."""
        return self.cli("run", "--devices", devices, str(SCRIPTS / name), *args, timeout=timeout, extra_env=extra_env)

    def cli(self, *args: str, timeout: float = 120, extra_env: dict | None = None):
        return self.run([sys.executable, "-m", "multigpu", *args], timeout, extra_env)

    def leftovers(self, wait: float = 5.0) -> list[int]:
        deadline = time.monotonic() + wait
        while True:
            pids = processes_with_token(self.token)
            if not pids or time.monotonic() > deadline:
                return pids
            time.sleep(0.2)


def run_beside(folder: Path, commands: dict, timeout: float) -> dict[str, subprocess.CompletedProcess]:
    """Runs ``commands`` (``name: (args, extra_env)``) at once in ``folder``, in a runner of their own, and checks
    that none left a process behind; returns each one's result by name.

    For a module's fixture: its one-device reference beside the parallel runs that `make test` checks against
    it, so that each finds the core the others leave idle while it imports (the runs of `make test-outside`'s
    cases start on their own, in their test).
    """
    runner = Runner(folder)
    try:
        done = runner.together(*commands.values(), timeout=timeout)
        left = runner.leftovers()
        assert left == [], f"processes left behind: {left}"
    finally:
        for pid in processes_with_token(runner.token):  # (as the runner fixture does after a test)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(runner.tmp, ignore_errors=True)
    return dict(zip(commands, done))


def run_together(*commands: dict, timeout: float) -> list[subprocess.CompletedProcess]:
    """Runs independent commands at once and waits for every one (each a dict of ``subprocess.Popen``'s arguments,
    ``args`` among them): a one-device reference beside the run it checks, so that each finds the core the other
    leaves idle while it imports.  Standard error joins standard output; every one still running at ``timeout``
    is killed with its process group, and the test fails."""
    started = []
    for command in commands:
        out = tempfile.TemporaryFile(mode="w+")
        started.append((subprocess.Popen(stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                         **command), out))
    deadline = time.monotonic() + timeout
    done = []
    for proc, out in started:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _ in started:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
                    other.wait()
            out.seek(0)
            text = out.read()[-3000:]
            for _, other_out in started:
                other_out.close()
            pytest.fail(f"timed out after {timeout}s: {proc.args}\n{text}")
        out.seek(0)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), ""))
        out.close()
    return done


@pytest.fixture(autouse=True)
def _own_profile(tmp_path, monkeypatch):
    """Measured profiles go to the test's own folder, never to the user's cache."""
    monkeypatch.setenv("MULTIGPU_PROFILE", str(tmp_path / "profiles.json"))


@pytest.fixture
def runner(tmp_path, request):
    r = Runner(tmp_path, gpu=request.node.get_closest_marker("cuda") is not None)
    yield r
    left = processes_with_token(r.token)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(r.tmp, ignore_errors=True)
    assert not left, f"processes left behind: {left}"
