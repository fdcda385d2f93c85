"""Global batches handed between the ranks of one machine through files in shared memory.

A *pass* is one run through an input: an epoch of a ``PyDataset``, one
iteration of a DataLoader, or a generator's whole stream.  Its global batches
are files ``{prefix}-{index}`` in a folder held in memory (``/dev/shm``; the
system's temporary folder where there is none).  A reader writes a batch under
a temporary name and renames it when it is whole, so a file that exists is
complete; the NumPy arrays in it are laid out as pickle's out-of-band buffers,
so a consumer maps the file and copies only its own rows.  A batch file may
instead say that the input ended, or that reading it failed (with the reading
rank and the original error).

The control file ``{prefix}-ctl`` holds one number per local rank: how many
batches of the pass it has consumed.  A reader waits while it is ``depth``
batches ahead of the slowest consumer, and removes its files once every
consumer is past them; each word has one writer, so no lock is needed.  Each
rank closes the pass once it is done with it, and the last one to close
removes whatever is left.  The folder's files of a run share the prefix
``multigpu-in-{run}-``: the supervisor removes any that a crashed run left.
"""

from __future__ import annotations

import errno
import glob
import mmap
import os
import pickle
import struct
import tempfile
import threading
import time
from collections import deque

import numpy as np

__all__ = ["InputError", "Pass", "StoppedError", "directory", "remove_run_files"]

_CLOSED = np.iinfo(np.int64).max // 2  # a consumer's count once it is done with the pass (or lost)

_BATCH, _END, _ERROR = 0, 1, 2
_HEAD = struct.Struct("<4sqqq")  # magic, kind, length of the pickled part, number of out-of-band buffers
_MAGIC = b"mgin"
_ALIGN = 64


class InputError(RuntimeError):
    """Reading a global batch failed on the rank that read it."""


class StoppedError(Exception):
    """The pass was closed while a reader waited to publish."""


def directory() -> str:
    """The folder the batch files live in: ``/dev/shm`` where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_run_files(run: str) -> int:
    """Removes every batch file of run ``run`` (after the run ended); returns how many there were."""
    removed = 0
    for path in glob.glob(os.path.join(directory(), f"multigpu-in-{run}-*")):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed


def _wait(ready, what: str, stop: threading.Event | None = None) -> None:
    """Polls ``ready()``: spins briefly, then sleeps in steps growing to 1 ms."""
    spins, pause = 0, 2e-5
    while not ready():
        if stop is not None and stop.is_set():
            raise StoppedError(what)
        spins += 1
        if spins < 100:
            continue
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _to_numpy(leaf):
    """Tensors travel as NumPy arrays: pickle would copy a torch tensor in-band, and a rank cuts its rows out of
    NumPy arrays only (JAX arrays, which Keras's grain-format dataset utilities yield on JAX, included)."""
    if type(leaf).__module__.startswith("torch") and hasattr(leaf, "numpy"):
        return leaf.detach().cpu().numpy()
    if not isinstance(leaf, (np.ndarray, np.generic)) and hasattr(leaf, "__array__") and hasattr(leaf, "shape"):
        return np.asarray(leaf)
    return leaf


class Pass:
    """One pass's batch files (see the module docstring).

    Args:
        prefix: path prefix of the pass's files (in :func:`directory`).
        local_rank: this rank's index on the machine.
        local_size: ranks on the machine.
        depth: how many global batches readers may publish ahead of the slowest consumer.
        lost: local ranks lost earlier in the run: they consume nothing, and the lowest rank left creates the
            control file.
    """

    def __init__(self, prefix: str, local_rank: int, local_size: int, depth: int, lost=()) -> None:
        self.prefix = prefix
        self.local_rank, self.local_size = local_rank, local_size
        self.depth = max(1, int(depth))
        self._control: np.ndarray | None = None
        self._published: deque[int] = deque()
        self._lock = threading.Lock()  # the consumer and a reader thread of one rank both open the control file
        self.closed = False
        lost = {r for r in lost if 0 <= r < local_size}
        if local_rank == min(set(range(local_size)) - lost):
            counts = np.zeros(local_size, dtype=np.int64)
            counts[sorted(lost)] = _CLOSED
            self._write(f"{prefix}-ctl", [counts.tobytes()])

    # ------------------------------------------------------------ files
    @staticmethod
    def _write(path: str, parts: list) -> None:
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            views = [memoryview(p).cast("B") for p in parts if len(memoryview(p).cast("B"))]
            while views:
                written = os.writev(fd, views)
                while views and written >= len(views[0]):
                    written -= len(views[0])
                    views.pop(0)
                if views and written:
                    views[0] = views[0][written:]
        except OSError as exc:
            os.close(fd)
            os.unlink(tmp)
            if exc.errno == errno.ENOSPC:
                size = sum(memoryview(p).nbytes for p in parts)
                raise OSError(exc.errno, f"{os.path.dirname(path)} is full: a global batch of {size / 2**20:.1f} MiB "
                              "(and a few ahead of the step) does not fit; give it more room (Docker: --shm-size) "
                              "or use smaller batches") from exc
            raise
        os.close(fd)
        os.rename(tmp, path)

    def _path(self, index: int) -> str:
        return f"{self.prefix}-{index}"

    def control(self) -> np.ndarray:
        """The consumed counts, one per local rank (mapped once the leader created the file)."""
        with self._lock:
            if self._control is None:
                path = f"{self.prefix}-ctl"
                _wait(lambda: os.path.exists(path), "the control file")
                fd = os.open(path, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, 8 * self.local_size)
                finally:
                    os.close(fd)
                self._control = np.frombuffer(mm, dtype=np.int64, count=self.local_size)
            return self._control

    # ------------------------------------------------------------ readers
    def wait_for_room(self, index: int, stop: threading.Event | None = None, start: int = 0) -> None:
        """Returns once global batch ``index`` may be read: fewer than ``depth`` batches wait unread, and
        fewer than ``start`` while the consumers have taken fewer than ``start`` (a slow start).

        Raises:
            StoppedError: when ``stop`` is set while waiting.
        """
        control = self.control()

        def ready() -> bool:
            done = int(control.min())
            return index < done + (start if done < start else self.depth)

        _wait(ready, "room in the queue", stop)

    def publish(self, index: int, batch, stop: threading.Event | None = None) -> None:
        """Writes global batch ``index`` once fewer than ``depth`` batches wait unread.

        Raises:
            StoppedError: when ``stop`` is set while waiting.
        """
        control = self.control()
        _wait(lambda: index < int(control.min()) + self.depth, "room in the queue", stop)
        self._forget_consumed(int(control.min()))
        import keras

        buffers: list[pickle.PickleBuffer] = []
        batch = keras.tree.map_structure(_to_numpy, batch)
        body = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
        self._emit(index, _BATCH, body, buffers)

    def publish_end(self, index: int) -> None:
        """Says that the input has no batch ``index`` (nor any after it)."""
        self._emit(index, _END, b"", [])

    def publish_error(self, index: int, reader: str, exc: BaseException) -> None:
        """Says that reading batch ``index`` failed on ``reader`` (a rank's name), with the error's text."""
        import traceback

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._emit(index, _ERROR, pickle.dumps((reader, type(exc).__name__, str(exc), text)), [])

    def _emit(self, index: int, kind: int, body: bytes, buffers: list) -> None:
        raws = [buf.raw() for buf in buffers]
        sizes = np.asarray([raw.nbytes for raw in raws], dtype=np.int64)
        parts: list = [_HEAD.pack(_MAGIC, kind, len(body), len(raws)), sizes.tobytes(), body]
        offset = _HEAD.size + sizes.nbytes + len(body)
        for raw in raws:
            pad = -offset % _ALIGN
            parts += [bytes(pad), raw]
            offset += pad + raw.nbytes
        self._write(self._path(index), parts)
        self._published.append(index)

    def _forget_consumed(self, consumed: int) -> None:
        while self._published and self._published[0] < consumed:
            try:
                os.unlink(self._path(self._published.popleft()))
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------ consumers
    def fetch(self, index: int):
        """Global batch ``index`` as ``("batch", structure)`` or ``("end", None)``; waits until it is there.

        The arrays of the structure are views of the mapped file: copy what you keep.

        Raises:
            InputError: when reading the batch failed, naming the reading rank and the error.
        """
        path = self._path(index)
        _wait(lambda: os.path.exists(path), f"global batch {index}")
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, kind, length, count = _HEAD.unpack_from(mm, 0)
        if magic != _MAGIC:
            raise InputError(f"multigpu: {path} is not a batch file")
        if kind == _END:
            return "end", None
        sizes = np.frombuffer(mm, dtype=np.int64, count=count, offset=_HEAD.size).tolist()
        start = _HEAD.size + 8 * count
        body = mm[start : start + length]
        if kind == _ERROR:
            reader, name, message, text = pickle.loads(body)
            raise InputError(f"reading global batch {index} of this pass failed on {reader}: {name}: {message}\n"
                             f"The reader's traceback:\n{text}")
        view = memoryview(mm)
        buffers = []
        offset = start + length
        for raw in sizes:
            offset += -offset % _ALIGN
            buffers.append(view[offset : offset + raw])
            offset += raw
        return "batch", pickle.loads(body, buffers=buffers)

    def consumed(self, count: int) -> None:
        """This rank is done with the first ``count`` batches."""
        self.control()[self.local_rank] = count

    def release(self, local_ranks) -> None:
        """Lost ranks of this machine consume nothing more: readers no longer wait for them, and the pass's
        files go once the ranks left are past them (their word has no writer left but this)."""
        control = self.control()
        for local in local_ranks:
            if 0 <= local < self.local_size:
                control[local] = _CLOSED

    def missing(self, first: int, step: int) -> int:
        """The first batch ``first + k * step`` not yet published that a rank left still needs (the batches of a
        lost reader's turn that another rank must read)."""
        control = self.control()
        needed = min(int(v) for v in control if int(v) < _CLOSED) if int(control.min()) < _CLOSED else 0
        index = first
        while index < needed or os.path.exists(self._path(index)):
            index += step
        return index

    def close(self) -> None:
        """This rank is done with the pass; the last rank to close removes what is left."""
        if self.closed:
            return
        self.closed = True
        control = self.control()
        control[self.local_rank] = _CLOSED
        self._forget_consumed(int(control.min()))
        if int(control.min()) >= _CLOSED:
            for path in glob.glob(f"{self.prefix}-*"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
