"""The entry point of started ranks runs the program as python would, and ends it without finalization."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from multigpu.runtime import processes, rank_entry

pytestmark = pytest.mark.timeout(60)

ENTRY = ["-m", "multigpu.runtime.rank_entry"]


@pytest.mark.parametrize(
    ("orig", "expected"),
    [
        (["py", "train.py", "--a", "1"], ["py", *ENTRY, "script", "train.py", "--a", "1"]),
        (["py", "-u", "-W", "ignore", "-X", "dev", "train.py"],
         ["py", "-u", "-W", "ignore", "-X", "dev", *ENTRY, "script", "train.py"]),
        (["py", "-Wignore", "-OO", "t.py", "-m", "x"], ["py", "-Wignore", "-OO", *ENTRY, "script", "t.py", "-m", "x"]),
        (["py", "-m", "pkg.train", "--epochs", "3"], ["py", *ENTRY, "module", "pkg.train", "--epochs", "3"]),
        (["py", "-B", "-c", "print(1)", "a"], ["py", "-B", *ENTRY, "code", "print(1)", "a"]),
    ],
)
def test_command_keeps_interpreter_options_and_arguments(orig, expected):
    assert processes.command(orig) == expected


@pytest.mark.parametrize("orig", [["py"], ["py", "-u"], ["py", "-"], ["py", "-m"]])
def test_command_without_a_program_is_an_error(orig):
    with pytest.raises(ValueError, match="No script, module or code"):
        processes.command(orig)


@pytest.mark.parametrize(("code", "expected"), [(None, 0), (0, 0), (7, 7), (True, 1), (256 + 3, 3), ("bye", 1)])
def test_exit_code_follows_the_interpreter(code, expected):
    assert rank_entry.exit_code(code) == expected


PROGRAM = textwrap.dedent(
    """
    import atexit, os, sys, threading, time
    atexit.register(lambda: print("atexit ran", flush=True))
    def late():
        time.sleep(0.3)
        print("thread finished", flush=True)
    threading.Thread(target=late).start()
    print("name", __name__, "argv", sys.argv[1:], "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
    sys.stdout.write("unflushed")
    if sys.argv[1] == "raise":
        raise RuntimeError("failing on purpose")
    sys.exit(int(sys.argv[1]))
    """
)


def _entry(tmp_path, *args):
    return subprocess.run([sys.executable, *ENTRY, *args], check=False, cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize(("arg", "code"), [("0", 0), ("7", 7), ("raise", 1)])
def test_a_script_runs_as_under_python_and_keeps_its_exit_code(tmp_path, arg, code):
    script = tmp_path / "sub" / "prog.py"
    script.parent.mkdir()
    script.write_text(PROGRAM)
    res = _entry(tmp_path, "script", str(script), arg)
    assert res.returncode == code, res.stderr
    assert f"name __main__ argv ['{arg}'] path0 True" in res.stdout
    # non-daemon threads are waited for, atexit handlers run, output is flushed
    assert "thread finished" in res.stdout and "atexit ran" in res.stdout and "unflushed" in res.stdout
    assert ("RuntimeError: failing on purpose" in res.stderr) == (arg == "raise")
    assert "rank_entry.py" not in res.stderr and "runpy" not in res.stderr  # the user's frames only


def test_modules_and_code_run_too(tmp_path):
    (tmp_path / "prog_mod.py").write_text(PROGRAM)
    res = _entry(tmp_path, "module", "prog_mod", "5")
    assert res.returncode == 5 and "name __main__ argv ['5']" in res.stdout, res.stderr
    res = _entry(tmp_path, "code", "import sys; print('code', sys.argv); sys.exit(4)", "x")
    assert res.returncode == 4 and "code ['-c', 'x']" in res.stdout, res.stderr


def test_an_interrupt_is_reported_through_the_excepthook(tmp_path):
    # multigpu's excepthook marks the run failed, so that the exit barrier is skipped
    code = "import sys; sys.excepthook = lambda t, e, tb: print('hook saw', t.__name__); raise KeyboardInterrupt"
    res = _entry(tmp_path, "code", code)
    assert res.returncode == 130 and "hook saw KeyboardInterrupt" in res.stdout, res.stderr


def test_code_runs_in_the_main_module(tmp_path):
    res = _entry(tmp_path, "code", "import sys\nclass A: pass\nprint(sys.modules['__main__'].A is A)")
    assert res.returncode == 0 and "True" in res.stdout, res.stderr


def test_a_bad_command_line_says_what_it_takes(tmp_path):
    res = _entry(tmp_path, "file", "x.py")
    assert res.returncode == 2 and "script,module,code" in res.stderr and "'file'" in res.stderr


def test_tensorflows_startup_info_lines_are_left_out_where_its_log_level_hides_info():
    if importlib.util.find_spec("tensorflow") is None:  # a look only: the processes below import it
        pytest.skip("TensorFlow is not installed")
    code = textwrap.dedent("""
        import importlib.util
        import sys
        print("before", file=sys.stderr, flush=True)
        assert importlib.util.find_spec("tensorflow") is not None  # a look first, as torch's import makes
        import tensorflow as tf
        print("imported", tf.constant(2.0).numpy() * 2, file=sys.stderr, flush=True)
    """)
    # oneDNN on, as TensorFlow's default is on a CPU with AVX-512 only: so it writes its line on every x86 CPU.
    # The two levels' processes at once (each imports TensorFlow: seconds of one core).
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "TF_ENABLE_ONEDNN_OPTS": "1"}
    procs = {level: subprocess.Popen([sys.executable, *ENTRY, "code", code], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**env, "TF_CPP_MIN_LOG_LEVEL": level})
             for level in ("1", "0")}
    for level, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 0, err
        assert "before" in err and "imported 4.0" in err, err
        # TensorFlow's oneDNN line is written while it is imported, before absl's log starts (so whatever the
        # level); on every backend: keras.utils.set_random_seed imports TensorFlow where it is installed
        assert ("oneDNN custom operations" in err) == (level == "0"), (level, err)
        assert ("All log messages before absl::InitializeLog()" in err) == (level == "0"), (level, err)


def test_what_tensorflows_import_writes_besides_its_info_lines_gets_out_at_once():
    """A line written while the import runs reaches standard error then, not at its end: an import that aborts
    the process (TensorFlow on a processor without the instructions it was built for) still says why."""
    code = textwrap.dedent("""
        import os, time
        from multigpu.runtime import rank_entry
        with rank_entry._startup_info_left_out():
            os.write(2, b"I0000 00:00:1795869687.981141   16961 port.cc:153] oneDNN custom operations are on.\\n")
            os.write(2, b"this processor lacks AVX\\n")
            time.sleep(0.5)
            os._exit(3)  # as an abort: nothing after this line runs
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 3, res.stderr
    assert "this processor lacks AVX" in res.stderr and "oneDNN" not in res.stderr, res.stderr


@pytest.mark.parametrize(("backend", "expected"), [
    ("torch", {"MKL_DISABLE_FAST_MM": "1"}),
    ("tensorflow", {"TF_MKL_ALLOC_MAX_BYTES": str(64 << 20)}),
    ("jax", {}),
])
def test_a_cpu_device_given_a_size_gets_its_backends_allocator_settings_and_only_that_rank(
        monkeypatch, backend, expected):
    import importlib

    from multigpu.devices import parse_devices

    facts = importlib.import_module(f"multigpu.backend.{backend}.facts").FACTS
    assert facts.cpu_memory_environment(128 << 20) == expected
    # the rank's environment, for the backend of this process (torch under make test)
    for name in ("MKL_DISABLE_FAST_MM", "TF_MKL_ALLOC_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)
    mine = importlib.import_module("multigpu.backend").facts().cpu_memory_environment(128 << 20)
    devices = parse_devices(["cpu:0/128MiB", "cpu:1"])
    bounded = processes.rank_environment(0, devices, 1234, None, "/tmp")
    free = processes.rank_environment(1, devices, 1234, None, "/tmp")
    assert {k: bounded[k] for k in mine} == mine
    assert not {"MKL_DISABLE_FAST_MM", "TF_MKL_ALLOC_MAX_BYTES"} & set(free)


_FREED = textwrap.dedent("""
    import sys
    import numpy as np
    from multigpu.runtime import processes
    if sys.argv[1] == "keep":
        processes.keep_freed_memory()
    def faults():
        return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
    def step():  # three 8 MiB buffers made and let go, as a step's host buffers are
        held = [np.ones(2 << 20, np.float32) for _ in range(3)]
        del held
    for _ in range(3):
        step()
    before = faults()
    for _ in range(20):
        step()
    print((faults() - before) / 20)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc: Linux")
def test_a_rank_keeps_the_memory_a_step_frees_for_the_next_step(tmp_path):
    """glibc's defaults give freed pages of this pattern back to the kernel, and the next step faults them in again
    (about a thousand page faults a step); a rank keeps them (none), unless the environment sets the thresholds."""
    script = tmp_path / "freed.py"
    script.write_text(_FREED)

    def faults(mode: str, **env) -> float:
        res = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60,
                             check=True, env={**os.environ, **env})
        return float(res.stdout.strip())

    assert faults("default") > 500
    assert faults("keep") < 10
    assert faults("keep", MALLOC_TRIM_THRESHOLD_="131072") > 500  # the user's own setting wins
