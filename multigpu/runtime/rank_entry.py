"""The entry point of every rank process that multigpu starts.

``python -m multigpu.runtime.rank_entry script PATH ARGS...`` (or ``module
NAME`` or ``code TEXT``) runs the user's program as ``python PATH ARGS...``
would (``call PAYLOAD`` calls the function that :func:`multigpu.launch`
pickled, and rank 0 leaves its return value beside it), then ends the
process the way :mod:`multiprocessing` ends its workers: it waits for the
program's threads, runs the ``atexit`` handlers (which leave the process
group together with the other ranks), flushes the output and calls
``os._exit`` with the program's exit code.  The handlers get the run's
timeout plus a few seconds: a rank never hangs in its own teardown.

Skipping the interpreter's finalization matters here: torch keeps the gloo
process group, and its worker threads, alive until the process ends, and a
C++ thread that touches a Python object while the interpreter is being torn
down aborts the process ("terminate called without an active exception"),
turning a finished rank into a failed one.

This module imports neither torch nor Keras, so that the program can choose
its Keras backend first.  Where TensorFlow's log level hides its INFO lines
(``TF_CPP_MIN_LOG_LEVEL``, 1 on every rank multigpu starts where unset), the
INFO lines it writes while it is imported, before its logging starts and so
whatever that level (the oneDNN line, absl's notice before them), are left
out of the rank's standard error; everything else it writes then is kept.

On JAX the rank joins the run before the program runs, and on TensorFlow it
binds its device then (:mod:`multigpu.backend.jax.group` and
:mod:`multigpu.backend.tensorflow.group` say why).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.util
import os
import re
import runpy
import sys
import threading
import types

from multigpu import env

KINDS = ("script", "module", "code", "call")


def _run(kind: str, target: str, args: list[str]) -> None:
    if kind == "script":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "call":
        _call(target)
    else:
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        module = types.ModuleType("__main__")  # as under -c, the code's globals are __main__'s
        sys.modules["__main__"] = module
        exec(compile(target, "<string>", "exec"), module.__dict__)


def _call(payload: str) -> None:
    """Calls the function :func:`multigpu.launch` pickled; rank 0 leaves its return value beside it."""
    import pickle

    import cloudpickle

    sys.argv = [payload]
    sys.path[0] = os.getcwd()  # the notebook's folder: modules beside it import as they do in the kernel
    with open(payload, "rb") as f:
        fn, args = pickle.load(f)
    result = fn(*args)
    from multigpu import membership

    members = membership.read(env.get(env.RUN_DIR))
    writer = str(members.members[0]) if members is not None else "0"  # rank 0, or the lowest left after a loss
    if env.get(env.RANK, "0") == writer:
        try:
            data = cloudpickle.dumps(result)
        except Exception as exc:
            raise TypeError("multigpu.launch: the function's return value must be picklable to reach the caller "
                            "(return history.history, model.get_weights() or numbers, not the model). Received: "
                            f"a {type(result).__name__} ({exc})") from exc
        path = os.path.join(os.path.dirname(payload), "result.pkl")
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)


def _note_traceback(exc: BaseException, tb) -> None:
    """Leaves the traceback for :func:`multigpu.launch`, which raises it in the caller."""
    folder = env.get(env.LAUNCH_DIR)
    if not folder:
        return
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, tb))
    path = os.path.join(folder, f"rank{env.get(env.RANK, '0')}.traceback")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError:  # pragma: no cover - the caller is gone
        pass


def _user_frames(tb):
    """The traceback from the program's own frames on (without this module's and runpy's)."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}

    def skipped(filename: str) -> bool:
        return filename == "<frozen runpy>" or os.path.abspath(filename) in ours

    while tb is not None and tb.tb_next is not None and skipped(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def exit_code(code: object) -> int:
    """The process exit code for ``SystemExit(code)``, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _join_early() -> None:
    """On JAX and TensorFlow, joins the run before the program runs: JAX allows it only before its first
    computation, and TensorFlow takes its devices and threads only then."""
    from multigpu import backend
    from multigpu.runtime import environments, start

    early = backend.name() in backend.SUPPORTED and backend.facts().join_first
    if early and environments.detect(env.copy()) is not None:
        start()


_QUIETED = "tensorflow"  # the package whose start-up INFO lines are left out (on every Keras backend)
_STARTUP_INFO = re.compile(r"^(I\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before absl::InitializeLog\(\))")


class _QuietTensorFlow(importlib.abc.MetaPathFinder):
    """Imports ``tensorflow``, the first time anything does, with the INFO lines it writes meanwhile left out (a
    look for it without importing it, as torch's ``find_spec`` probe, leaves this in place)."""

    def __init__(self) -> None:
        self._looking = False

    def find_spec(self, name, path=None, target=None):
        if name != _QUIETED or self._looking:
            return None
        self._looking = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._looking = False
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader, self)
        return spec


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader, finder: _QuietTensorFlow) -> None:
        self.loader = loader
        self.finder = finder

    def __getattr__(self, name):  # resources and the like: the package's own loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        module.__loader__ = module.__spec__.loader = self.loader
        with _startup_info_left_out():
            self.loader.exec_module(module)


@contextlib.contextmanager
def _startup_info_left_out():
    """Standard error (the file descriptor: C++ writes there) through a pipe meanwhile, each line passed on as it
    comes but the INFO lines absl writes before its logging starts (a line an aborting import writes still gets
    out)."""
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    passer = threading.Thread(target=_pass_on, args=(read, saved), name="multigpu-stderr", daemon=True)
    passer.start()
    os.dup2(write, 2)
    os.close(write)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer gone: the thread reads to its end
        passer.join(timeout=5.0)
        os.close(saved)


def _pass_on(read: int, out: int) -> None:
    """Copies ``read`` to ``out`` line by line until its end, leaving out :data:`_STARTUP_INFO`'s lines."""
    rest = b""
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            *lines, rest = (rest + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not _STARTUP_INFO.match(line.decode(errors="replace")))
            if kept:
                _write(out, kept)
    if rest and not _STARTUP_INFO.match(rest.decode(errors="replace")):
        _write(out, rest)


def _write(out: int, data: bytes) -> None:
    try:
        os.write(out, data)
    except OSError:  # standard error closed, or the import outlived the wait for its last lines
        pass


def main(argv: list[str]) -> int:
    """Runs the program named by ``argv`` (kind, target, args) and returns its exit code."""
    if len(argv) < 2 or argv[0] not in KINDS:
        print(f"usage: python -m {__name__} {{{','.join(KINDS)}}} TARGET [ARGS...]; received {argv!r}",
              file=sys.stderr)
        return 2
    if (env.get("TF_CPP_MIN_LOG_LEVEL") or "0") not in ("", "0") and _QUIETED not in sys.modules:
        sys.meta_path.insert(0, _QuietTensorFlow())
    try:
        _join_early()
        _run(argv[0], argv[1], argv[2:])
        code = 0
    except SystemExit as exc:
        code = exit_code(exc.code)
    except BaseException as exc:
        # Through sys.excepthook, as the interpreter reports it: multigpu's
        # hook notes the failure so that the exit does not wait for peers.
        tb = _user_frames(exc.__traceback__)
        _note_traceback(exc, tb)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    return code


def _deadline_for_exit() -> float:
    try:
        return float(env.get(env.TIMEOUT) or "60") + 10.0
    except ValueError:
        return 70.0


def _finish(code: int) -> None:
    """Ends the process as the interpreter would, minus its finalization."""
    # As the interpreter does: first the threading module's exit hooks (they stop the
    # workers of concurrent.futures executors), then wait for the non-daemon threads.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # pragma: no cover - every CPython we support has it
        main_thread = threading.main_thread()
        for t in threading.enumerate():
            if t is not main_thread and not t.daemon and t.is_alive():
                t.join()
    # Bounded: a handler stuck in C++ (a collective with a vanished peer) must not keep the rank alive.
    timer = threading.Timer(_deadline_for_exit(), os._exit, args=(code or 1,))
    timer.daemon = True
    try:
        threading.stack_size(1 << 18)  # (a device given a size may have no room left for 8 MiB of stack)
        timer.start()
    except (RuntimeError, ValueError):  # no thread to be had: the exit goes on unbounded
        pass
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


if __name__ == "__main__":
    _finish(main(sys.argv[1:]))
