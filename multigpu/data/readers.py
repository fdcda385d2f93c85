"""Inputs one machine reads once for all its ranks: ``PyDataset``, generators, iterable datasets.

What cannot be indexed by row is read as global batches, in background
threads, ahead of the training loop, and handed to the machine's ranks through
:mod:`multigpu.data.exchange`; each rank copies only its rows, cut when it
takes the batch (so shares that move between steps are always the current
ones):

* :class:`PyDatasetSource`: the machine's ranks take turns: local rank ``l``
  of ``L`` reads global batches ``l, l+L, l+2L, ...`` of the epoch's order
  with the dataset's own ``workers``, ``use_multiprocessing`` and
  ``max_queue_size`` (Keras's own enqueuer), so the reading is spread over
  the ranks' cores and each batch is read once per machine;
* :class:`~multigpu.data.streams.StreamSource`: a generator, or a DataLoader
  that cannot be cut by index, is iterated by local rank 0 alone, in a thread.

A failure while reading reaches every rank of the machine at that batch,
naming the rank that read it and the original error.

When a rank of the machine is lost (:func:`lose`), the ranks left stop
waiting for it, cut the batch being stepped on again from its file (each
plan's ``again``), and a ``PyDataset``'s lost turn of reading is taken over
by the lowest rank left; a stream's reader cannot be replaced (the stream's
state died with it), so losing it ends the run, saying so.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import weakref
from collections.abc import Callable, Iterator

import keras
import numpy as np

from multigpu import failure
from multigpu._keras import compat as _compat
from multigpu.data.exchange import Pass, StoppedError
from multigpu.data.forms import batch_rows, standardize
from multigpu.data.host import Host
from multigpu.planning.plan import StepPlan

__all__ = ["OPEN", "PyDatasetSource", "Reader", "cut_again", "cut_rows", "fingerprint", "lose", "take"]

OPEN: weakref.WeakSet = weakref.WeakSet()  # the sources with a pass open in this process


def lose(ranks) -> None:
    """Ranks were lost: every open source of this process stops waiting for those of its machine and takes over
    their part of the reading (see the module docstring)."""
    for source in list(OPEN):
        host = source.host
        local = [r - host.leader for r in ranks if 0 <= r - host.leader < host.local_size]
        if local:
            source.lose(local)


def cut_rows(batch, rows: int, begin: int, end: int):
    """A copy of rows ``[begin, end)`` of every array with ``rows`` rows (other leaves as they are)."""

    def cut(leaf):
        if isinstance(leaf, np.ndarray):
            return np.array(leaf[begin:end] if leaf.ndim and leaf.shape[0] == rows else leaf)
        return leaf

    return keras.tree.map_structure(cut, batch)


class Reader:
    """A daemon thread running ``read(publish, stop)``; an error is published at the batch it was reading."""

    def __init__(self, name: str, host: Host, pass_: Pass, read: Callable) -> None:
        self.host, self.pass_ = host, pass_
        self.stop = threading.Event()
        self.next = 0  # the batch the reader is reading, where an error is published
        self._read = read
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def publish(self, index: int, batch) -> None:
        self.next = index
        self.pass_.publish(index, batch, self.stop)

    def _run(self) -> None:
        try:
            self._read(self)
        except StoppedError:
            pass
        except BaseException as exc:  # any error of the user's loader ends the run at its batch
            if self.stop.is_set():
                return
            try:
                self.pass_.publish_error(self.next, self.host.label, exc)
            except BaseException as failed:  # the other ranks cannot be told: end this rank, which ends the run
                failure.fail(f"reading global batch {self.next} failed ({type(exc).__name__}: {exc}), and saying so to "
                     f"the other ranks failed too ({type(failed).__name__}: {failed})")

    def close(self, timeout: float = 10.0) -> None:
        self.stop.set()
        self._thread.join(timeout)


def take(pass_: Pass, index: int, plan_of: Callable[[int], StepPlan], marks: list | None = None):
    """Batch ``index`` of the pass, this rank's rows copied out, or None at the input's end.

    ``marks``: a list that receives the global batch's :func:`fingerprint` (several machines).
    """
    kind, batch = pass_.fetch(index)
    if kind == "end":
        return None
    batch = standardize(batch)
    rows = batch_rows(batch)
    if marks is not None:
        marks.append(fingerprint(batch, rows))
    plan = plan_of(rows, again=functools.partial(cut_again, pass_, index))
    begin, end = plan.rows(plan.rank)
    return cut_rows(batch, rows, begin, end)


def cut_again(pass_: Pass, index: int, plan: StepPlan):
    """This rank's rows of batch ``index`` by another ``plan`` (after a loss; the file stays until every rank
    left is past it)."""
    _, batch = pass_.fetch(index)
    batch = standardize(batch)
    begin, end = plan.rows(plan.rank)
    return cut_rows(batch, batch_rows(batch), begin, end)


def fingerprint(batch, rows: int) -> int:
    """A number under 2**22 that tells global batches apart: a digest of every array's shape and first and
    last rows.  A batch of the same rows in another order (an unseeded shuffle) almost always differs there;
    hashing whole batches at every step would cost about a millisecond per megabyte.  Small enough to be
    summed exactly in float32."""
    digest = hashlib.blake2b(digest_size=8)
    for leaf in keras.tree.flatten(batch):
        if isinstance(leaf, np.ndarray):
            digest.update(repr((leaf.shape, leaf.dtype.str)).encode())
            if leaf.ndim and rows:
                digest.update(np.ascontiguousarray(leaf[[0, rows - 1]] if leaf.shape[0] == rows else leaf[:1]))
    return int.from_bytes(digest.digest(), "little") % (1 << 22)


class _Stripe(keras.utils.PyDataset):
    """Global batches ``order[i]`` for ``i = first, first + step, ...`` of a dataset, with its workers."""

    def __init__(self, dataset, order, first: int, step: int) -> None:
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self.dataset, self.order, self.first, self.step = dataset, order, first, step

    def global_index(self, j: int) -> int:
        return self.first + j * self.step

    def __len__(self) -> int:
        n = self.dataset.num_batches
        return max(0, -(-(n - self.first) // self.step))

    @property
    def num_batches(self):
        return None if self.dataset.num_batches is None else len(self)

    def __getitem__(self, j: int):
        i = self.global_index(j)
        return self.dataset[int(self.order[i]) if self.order is not None else i]

    def on_epoch_begin(self) -> None:  # the user's dataset hears of epochs from the training loop, once
        pass

    def on_epoch_end(self) -> None:
        pass


class PyDatasetSource:
    """A ``keras.utils.PyDataset``, each global batch read once per machine (see the module docstring).

    Args:
        dataset: the user's dataset.
        shuffle: shuffle the order of its batches each epoch (drawn from the shared seed).
        seed: the run's shared seed.
        host: this rank's machine.
    """

    def __init__(self, dataset, shuffle: bool, seed: int, host: Host) -> None:
        self.dataset, self.shuffle, self.seed = dataset, bool(shuffle), int(seed)
        self.host = host
        self.stream = host.stream()
        self.order: np.ndarray | None = None
        self.passes = 0
        self.depth = max(2 * host.local_size, int(dataset.max_queue_size), 4)
        self._live: tuple[Pass, list[Reader]] | None = None  # the open pass and its readers on this rank
        self._lost: set[int] = set()  # local ranks lost: their turns are read by the lowest rank left

    @property
    def num_batches(self):
        return self.dataset.num_batches

    def set_epoch(self, epoch: int) -> None:
        n = self.dataset.num_batches
        self.order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle and n else None

    def _read(self, stripe: _Stripe) -> Callable:
        def read(reader: Reader) -> None:
            if stripe.num_batches == 0:
                return
            adapter = _compat.PyDatasetAdapter(stripe, shuffle=False)
            adapter.on_epoch_begin()
            try:
                j = 0
                reader.next = stripe.global_index(0)
                iterator = iter(adapter.get_numpy_iterator())
                while not reader.stop.is_set():
                    reader.next = stripe.global_index(j)
                    try:
                        batch = next(iterator)
                    except StopIteration:
                        return
                    except IndexError:  # a dataset without a length ends with IndexError, as in Keras
                        reader.pass_.publish_end(reader.next)
                        return
                    reader.publish(reader.next, batch)
                    j += 1
            finally:
                adapter.on_epoch_end()
        return read

    def batches(self, plan_of: Callable[[int], StepPlan]) -> Iterator:
        host, n = self.host, self.dataset.num_batches
        pass_ = host.open_pass(self.stream, self.passes, self.depth, self._lost)
        self.passes += 1
        readers: list[Reader] = []
        self._live = (pass_, readers)
        OPEN.add(self)
        for turn in [host.local_rank, *sorted(self._lost)] if self._reads_for_lost() else [host.local_rank]:
            self._start_turn(turn, turn)
        try:
            i = 0
            while n is None or i < n:
                batch = take(pass_, i, plan_of)
                if batch is None:
                    return
                yield batch
                i += 1
                pass_.consumed(i)
        finally:
            self._live = None
            OPEN.discard(self)
            for reader in readers:
                reader.close()
            pass_.close()

    def _reads_for_lost(self) -> bool:
        """Whether this rank reads the turns of the machine's lost ranks (the lowest rank left does)."""
        left = [r for r in range(self.host.local_size) if r not in self._lost]
        return bool(left) and self.host.local_rank == left[0]

    def _start_turn(self, turn: int, first: int) -> None:
        """Reads turn ``turn``'s global batches (``turn``, ``turn + L``, ...) from batch ``first`` on."""
        pass_, readers = self._live
        stripe = _Stripe(self.dataset, self.order, first, self.host.local_size)
        readers.append(Reader(f"multigpu-read-{self.stream}-{turn}", self.host, pass_, self._read(stripe)))

    def lose(self, local_ranks) -> None:
        """Lost ranks of this machine: the pass no longer waits for them, and the lowest rank left reads
        their turns from the first batch not yet published."""
        new = [r for r in local_ranks if r not in self._lost]
        self._lost.update(new)
        if self._live is None or not new:
            return
        pass_, _ = self._live
        pass_.release(new)
        if self._reads_for_lost():
            for turn in new:
                self._start_turn(turn, pass_.missing(turn, self.host.local_size))

    def on_epoch_begin(self) -> None:
        if hasattr(self.dataset, "on_epoch_begin"):
            self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()

    def close(self) -> None:
        pass
