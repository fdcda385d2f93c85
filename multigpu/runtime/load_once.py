"""Arrays loaded once per machine and shared, read-only, by every process of the run there.

:func:`load_once` runs the user's loading function in one process per
machine and puts the NumPy arrays it returns in one anonymous shared memory
file (``memfd_create``: it has no name under ``/dev/shm``, and the kernel
frees it when the last process holding it ends, however it ends).  The other
processes map the same pages, so the machine holds the data once.

Which process loads, and how the others get the file:

* a plain ``python train.py``: the script's first process (which becomes the
  supervisor at ``parallelize``) loads; the file stays open across the
  supervisor's ``exec`` and every rank inherits it (its descriptor is named in
  ``MULTIGPU_SHARED_ARRAYS``); a rank's ``k``-th call maps the ``k``-th file;
* ``multigpu run``, ``multigpu.launch`` and outside launchers (torchrun,
  ``srun``, ``mpirun``): local rank 0 loads and hands the descriptor to the
  machine's other ranks over an abstract Unix socket (no file either; one
  per network namespace, so hosts simulated in namespaces load once each).

The file starts with a header (its length, then a pickle of the returned
structure with each array replaced by its dtype, shape and offset); the
arrays follow, each aligned to 64 bytes.  ``np.load`` of a ``.npy`` path is
read from the file straight into its place (no array of the process's own);
any other function's arrays are copied there, each let go of once copied.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import socket
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from multigpu import env
from multigpu.runtime import environments

__all__ = ["load_once"]

ALIGN = 64
_calls = 0  # this process's load_once calls so far: the k-th call of every process shares one file


@dataclass(frozen=True)
class _Slot:
    """Where one array lies in the file."""

    dtype: str
    shape: tuple[int, ...]
    offset: int


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _map(value, kind: type, fn: Callable):
    """``value`` (any nesting of tuples, named tuples, lists and dicts) with each leaf of type ``kind`` replaced
    by ``fn(leaf)``; other leaves as they are."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map(v, kind, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, kind, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map(v, kind, fn)) for k, v in value.items())
    return value


def _plan(value, arrays: list):
    """``value`` with every NumPy array replaced by its :class:`_Slot` (``(slot, array)`` appended to ``arrays``)."""
    def slot_of(array: np.ndarray) -> _Slot:
        if array.dtype.hasobject:
            raise TypeError(f"load_once shares arrays of numbers, strings and bytes; this array has dtype "
                            f"{array.dtype} (Python objects), which cannot live in shared memory. Received an "
                            f"array of shape {array.shape}.")
        offset = _align(arrays[-1][0].offset + arrays[-1][1].nbytes) if arrays else 0
        slot = _Slot(array.dtype.str if array.dtype.fields is None else array.dtype.descr, array.shape, offset)
        arrays.append((slot, array))
        return slot

    return _map(value, np.ndarray, slot_of)


def _views(value, buffer: mmap.mmap, base: int):
    """The structure of :func:`_plan` with each slot replaced by a read-only view of the file."""
    def view(slot: _Slot) -> np.ndarray:
        dtype = np.dtype(slot.dtype if isinstance(slot.dtype, str) else [tuple(f) for f in slot.dtype])
        count = int(np.prod(slot.shape, dtype=np.int64))
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=base + slot.offset).reshape(slot.shape)

    return _map(value, _Slot, view)


def _new_file(layout, end: int) -> tuple[int, mmap.mmap, int]:
    """A new anonymous shared file of ``end`` bytes of arrays after the header of ``layout``: its descriptor, a
    writable mapping and where the arrays begin."""
    header = pickle.dumps(layout, protocol=pickle.HIGHEST_PROTOCOL)
    base = _align(8 + len(header))
    size = max(base + end, 1)
    fd = os.memfd_create("multigpu-load-once", 0)
    try:
        os.ftruncate(fd, size)
        out = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    out[:8] = struct.pack("<Q", len(header))
    out[8 : 8 + len(header)] = header
    return fd, out, base


def _write(result) -> int:
    """A new anonymous shared file holding ``result``; returns its descriptor (inheritable).

    Each array is let go of once it is copied, so that where nothing else
    holds the function's arrays the machine holds at most one of them twice.
    """
    arrays: list = []
    layout = _plan(result, arrays)
    del result
    end = arrays[-1][0].offset + arrays[-1][1].nbytes if arrays else 0
    fd, out, base = _new_file(layout, end)
    try:
        with out:
            arrays.reverse()
            while arrays:
                slot, array = arrays.pop()
                target = np.frombuffer(out, dtype=array.dtype, count=array.size, offset=base + slot.offset)
                target[...] = array.reshape(-1)
                del target, array
    except BaseException:
        os.close(fd)
        raise
    os.set_inheritable(fd, True)
    return fd


_NPY_KEYWORDS = {"mmap_mode", "allow_pickle", "max_header_size"}


def _npy_file(fn: Callable, args: tuple, kwargs: dict) -> str | os.PathLike | None:
    """The path of a ``.npy`` file when the call is ``np.load(path, ...)`` of one (the array read straight into
    shared memory); None for any other call."""
    if fn is not np.load or len(args) != 1 or not set(kwargs) <= _NPY_KEYWORDS:
        return None
    path = args[0]
    if not isinstance(path, (str, os.PathLike)):
        return None
    try:
        with open(path, "rb") as f:
            return path if f.read(6) == b"\x93NUMPY" else None
    except OSError:
        return None  # np.load raises its own error


def _write_npy(path: str | os.PathLike, max_header_size: int | None = None) -> int | None:
    """The array of the ``.npy`` file at ``path`` read straight into a new shared file (the machine holds it
    once, also while it loads); its descriptor, or None for a file the generic path takes (Python objects,
    Fortran order)."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        version = fmt.read_magic(f)
        extra = {} if max_header_size is None else {"max_header_size": max_header_size}
        read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran_order, dtype = read_header(f, **extra)
        if dtype.hasobject or (fortran_order and len(shape) > 1):
            return None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        slot = _Slot(dtype.str if dtype.fields is None else dtype.descr, tuple(shape), 0)
        fd, out, base = _new_file(slot, nbytes)
        try:
            with out, memoryview(out) as view:
                done, chunk = 0, 64 << 20
                while done < nbytes:
                    with view[base + done : base + min(nbytes, done + chunk)] as part:
                        read = f.readinto(part)
                    if not read:
                        raise ValueError(f"multigpu.load_once: {os.fspath(path)!r} ends after {done} of the "
                                         f"{nbytes} bytes its header announces (shape {tuple(shape)}, dtype "
                                         f"{dtype}).")
                    done += read
        except BaseException:
            os.close(fd)
            raise
    os.set_inheritable(fd, True)
    return fd


def _load(fn: Callable, args: tuple, kwargs: dict) -> int:
    """Runs the user's loading and writes its arrays to a new shared file; returns its descriptor."""
    path = _npy_file(fn, args, kwargs)
    if path is not None:
        fd = _write_npy(path, kwargs.get("max_header_size"))
        if fd is not None:
            return fd
    return _write(fn(*args, **kwargs))


def _read(fd: int):
    """The structure in the shared file ``fd``, its arrays read-only views (the mapping, which holds a
    descriptor of its own, stays open while they live)."""
    size = os.fstat(fd).st_size
    buffer = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    (length,) = struct.unpack("<Q", buffer[:8])
    layout = pickle.loads(buffer[8 : 8 + length])
    return _views(layout, buffer, _align(8 + length))


def _inherited() -> list[int]:
    """The descriptors of the files the supervisor loaded, in call order (``MULTIGPU_SHARED_ARRAYS``)."""
    text = env.get(env.SHARED_ARRAYS)
    if not text:
        return []
    try:
        return [int(fd) for fd in json.loads(text)]
    except (ValueError, TypeError):
        return []


def inherited_fds() -> tuple[int, ...]:
    """The shared files a supervisor passes on to the ranks it starts."""
    return tuple(fd for fd in _inherited() if _is_open(fd))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _address(found: environments.Environment, call: int) -> bytes:
    """The abstract socket of the ``call``-th file of this run on this machine."""
    run = "|".join(str(x) for x in (found.master_addr, found.master_port, env.get(env.RUN_DIR, ""),
                                   env.get("TORCHELASTIC_RUN_ID", ""), env.get("TORCHELASTIC_RESTART_COUNT", ""),
                                   env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")))
    return f"\0multigpu-load-once-{zlib.crc32(run.encode()):08x}-{call}".encode()


def _timeout() -> float:
    try:
        return float(env.get(env.TIMEOUT) or 300.0)
    except ValueError:
        return 300.0


def _serve(fd: int, address: bytes, peers: int, timeout: float) -> None:
    """Local rank 0: hands ``fd`` to the machine's ``peers`` other ranks."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(address)
        server.listen(max(1, peers))
        server.settimeout(timeout)
        for _ in range(peers):
            try:
                conn, _ = server.accept()
            except TimeoutError:
                raise TimeoutError(f"multigpu.load_once: local rank 0 waited {timeout:g} s for the other "
                                   f"{peers} rank(s) of this machine to call load_once; every rank must make the "
                                   "same load_once calls in the same order.") from None
            with conn:
                socket.send_fds(conn, [b"F"], [fd])
                conn.recv(1)  # the peer has the descriptor
    finally:
        server.close()


def _receive(address: bytes, timeout: float) -> int:
    """Another local rank: the descriptor local rank 0 serves at ``address``."""
    deadline = time.monotonic() + timeout
    while True:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(address)
            client.settimeout(max(1.0, deadline - time.monotonic()))
            _, fds, _, _ = socket.recv_fds(client, 1, 1)
            client.sendall(b"K")
            if fds:
                return fds[0]
        except (ConnectionRefusedError, FileNotFoundError):
            pass
        finally:
            client.close()
        if time.monotonic() > deadline:
            raise TimeoutError(f"multigpu.load_once: waited {timeout:g} s for local rank 0 of this machine to load "
                               "the data; every rank must make the same load_once calls in the same order.")
        time.sleep(0.02)


def load_once(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``fn(*args, **kwargs)`` once per machine; every process of the run there gets its arrays, shared.

    The NumPy arrays ``fn`` returns, in any nesting of tuples, lists and
    dicts, go to shared memory; every process of the machine (the ranks, and
    under ``python train.py`` the script's first process) gets read-only views
    of the same pages, so the machine holds them once however many devices it
    has.  Other values in the structure (numbers, strings) are copied.
    Nothing is left in ``/dev/shm``: the memory is anonymous and the kernel
    frees it when the last process of the run that maps it ends, however it
    ends.

    ``load_once(np.load, path)`` of a ``.npy`` file reads the file straight
    into the shared memory: the machine holds the array once, also while it
    loads.  Any other function runs as it is, and its arrays are copied into
    the shared memory one after another, each let go of once copied (while
    one is copied, the machine holds it twice).

    Where it runs: under ``python train.py``, in the script's first process
    (before ``parallelize`` turns it into the supervisor), and the ranks take
    its file; under ``multigpu run``, ``multigpu.launch`` and an outside
    launcher, in each machine's local rank 0, which hands the file to the
    machine's other ranks.  Every process must make the same ``load_once``
    calls in the same order.

    Example:
        ```python
        x, y = multigpu.load_once(np.load, "x.npy"), multigpu.load_once(np.load, "y.npy")
        model = multigpu.parallelize(model)
        model.fit(x, y, batch_size=256)
        ```

    Args:
        fn: the loading function.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        What ``fn`` returns, each NumPy array replaced by a read-only view of
        shared memory (write to a copy: ``x = x.copy()``).

    Raises:
        TypeError: when ``fn`` is not callable, or returns an array of Python objects.
        TimeoutError: when the machine's ranks do not all call ``load_once``.
    """
    global _calls
    if not callable(fn):
        raise TypeError(f"load_once takes a function that loads the data, then its arguments, e.g. "
                        f"load_once(np.load, 'x.npy'). Received: {fn!r} of type {type(fn).__name__}")
    call = _calls
    _calls += 1
    inherited = _inherited()
    if call < len(inherited) and _is_open(inherited[call]):
        return _read(inherited[call])
    try:
        found = environments.detect(env.copy())
    except ValueError:
        found = None
    if found is None:  # the script's first process: load, and keep the file for the ranks it will start
        fd = _load(fn, args, kwargs)
        env.put(env.SHARED_ARRAYS, json.dumps([*inherited, fd]))
        return _read(fd)
    address = _address(found, call)
    if found.local_size <= 1:
        fd = _load(fn, args, kwargs)
    elif found.local_rank == 0:
        fd = _load(fn, args, kwargs)
        _serve(fd, address, found.local_size - 1, _timeout())
    else:
        fd = _receive(address, _timeout())
    try:
        return _read(fd)
    finally:
        os.close(fd)
