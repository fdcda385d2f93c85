"""A generator or an iterable that cannot be cut by index, read once per machine by one rank, in a thread.

It shares the readers' machinery (:mod:`multigpu.data.readers`): global
batches handed to the machine's ranks through :mod:`multigpu.data.exchange`,
each rank taking its rows when it steps on the batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator

from multigpu import failure
from multigpu._warn import warn_user
from multigpu.data.exchange import InputError, Pass
from multigpu.data.host import Host
from multigpu.data.readers import OPEN, Reader, take
from multigpu.planning.plan import StepPlan

__all__ = ["StreamSource"]


class StreamSource:
    """A generator or an iterable that cannot be cut by index, read by one rank per machine.

    A generator runs once: it is one stream for the whole call, and a batch
    that was taken but not trained on (Keras takes one to build the model) is
    given again at the next pass.  A re-iterable input (a DataLoader) is read
    again at each pass.  With several machines, each reads its own copy, and
    the ranks check at every batch that all of them still have one, and the
    same one (by its :func:`fingerprint`).

    Args:
        source: the generator or iterable.
        host: this rank's machine.
        depth: global batches read ahead.
        slow_start: read at most this many batches of a pass before the ranks have taken as many (then
            ``depth``), and no batch before there is room for it.  Keras reads two batches of the pass
            it opens to build the model and leaves it; reading no further keeps state that a pass
            shares with the next one (a ``tf.data`` shuffle's seed, drawn anew at each repetition)
            where Keras leaves it.
    """

    def __init__(self, source: Iterable, host: Host, depth: int = 4, slow_start: int = 0) -> None:
        self.source, self.host = source, host
        self.slow_start = slow_start
        self.one_shot = inspect.isgenerator(source) or iter(source) is source
        self.stream = host.stream()
        self.depth = max(depth, 2 * host.local_size)
        self.passes = 0
        self._pass: Pass | None = None
        self._reader: Reader | None = None
        self._live: Pass | None = None  # the pass open now
        self._position = 0  # of a one-shot stream: the next batch not yet trained on
        self._said_apart = False
        self._lost: set[int] = set()

    @property
    def num_batches(self):
        try:
            return len(self.source)
        except TypeError:
            return None

    def set_epoch(self, epoch: int) -> None:
        pass

    def _read(self, reader: Reader) -> None:
        i = 0
        items = iter(self.source)
        while True:
            if self.slow_start:
                reader.pass_.wait_for_room(i, reader.stop, self.slow_start)
            try:
                item = next(items)
            except StopIteration:
                break
            if reader.stop.is_set():
                return
            reader.publish(i, item)
            i += 1
            reader.next = i
        reader.pass_.publish_end(i)

    def _open(self) -> Pass:
        pass_ = self.host.open_pass(self.stream, self.passes, self.depth, self._lost)
        self.passes += 1
        if self.host.local_rank == 0:
            self._reader = Reader(f"multigpu-read-{self.stream}", self.host, pass_, self._read)
        self._live = pass_
        OPEN.add(self)
        return pass_

    def lose(self, local_ranks) -> None:
        """Lost ranks of this machine: the pass no longer waits for them.  The reader (local rank 0) cannot be
        replaced: the stream's state died with it."""
        if 0 in local_ranks:
            failure.fail(f"the rank that read this input for its machine (rank {self.host.leader}) was lost: a "
                         "generator, iterator or tf.data stream cannot be read on from where it was by another "
                         "rank. Going on after losing it needs arrays, tensors, a keras.utils.PyDataset or a "
                         "DataLoader over a map-style dataset.")
        self._lost.update(local_ranks)
        if self._live is not None:
            self._live.release(local_ranks)

    def batches(self, plan_of: Callable[[int], StepPlan]) -> Iterator:
        if self.one_shot:
            if self._pass is None:
                self._pass = self._open()
            pass_, i = self._pass, self._position
        else:
            pass_, i = self._open(), 0
        try:
            while True:
                marks = [] if self.host.hosts > 1 else None
                batch = take(pass_, i, plan_of, marks)
                if marks is not None:
                    self._agree(marks[0] if marks else None, i)
                if batch is None:
                    return
                yield batch
                i += 1
                if self.one_shot:
                    self._position = i
                pass_.consumed(i)
        finally:
            if not self.one_shot:
                self._close(pass_)

    def _agree(self, mark: int | None, index: int) -> None:
        """With several machines, every rank must still have a batch, or none may; and every machine's copy
        should give the same batch (said once, by rank 0, when it does not)."""
        comm = self.host.comm
        marks = [0.0] * comm.world_size
        marks[self.host.rank] = 0.0 if mark is None else float(mark + 1)
        marks = comm.sum_floats(marks, "checking that every machine's input has the next batch")
        with_batch = [r for r, v in enumerate(marks) if v]
        if 0 < len(with_batch) < comm.world_size:
            without = [r for r, v in enumerate(marks) if not v]
            raise InputError(f"the input ran out after {index} batches on rank(s) {without} while rank(s) "
                             f"{with_batch} still had batch {index}: every machine reads its own copy of this "
                             "input, and every copy must yield the same global batches.")
        if with_batch and len(set(marks)) > 1 and self.host.rank == 0 and not self._said_apart:
            self._said_apart = True
            apart = sorted({r for r in with_batch if marks[r] != marks[0]})
            warn_user(f"global batch {index} differs between machines (rank(s) {apart} got another batch than "
                      "rank 0): every machine reads its own copy of this input, and the copies give their batches "
                      "in different orders (a shuffle without a seed: `dataset.shuffle(n, seed=S)`, or "
                      "keras.utils.set_random_seed before building the dataset). Each machine trains on its own "
                      "order, so the run does not reproduce one device.")

    def _close(self, pass_: Pass) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._live is pass_:
            self._live = None
            OPEN.discard(self)
        pass_.close()

    def close(self) -> None:
        if self._pass is not None:
            self._close(self._pass)
            self._pass = None
