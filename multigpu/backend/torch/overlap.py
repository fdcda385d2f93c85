"""Gradient sums started while the backward pass still runs (between machines and on GPUs).

A bucket is a run of consecutive variables of one optimizer call, taken in
reverse order (the last layers' gradients are ready first), up to
:data:`BUCKET_BYTES` (the first one :data:`FIRST_BUCKET_BYTES`, so that
communication starts early), as DDP's reducer cuts them.  Each variable's
tensor carries a post-accumulate-grad hook: when the backward pass has
written its gradient, the hook writes ``weight * grad`` into the variable's
slot of the bucket, and once every variable of a bucket is written the bucket
is summed with an asynchronous all-reduce, buckets always in the same order
on every rank.  At ``optimizer.apply`` the remaining buckets (variables with
no gradient this step: zeros) and the tail (used flags, extras, header) are
summed, every sum awaited, and the summed gradients go to the optimizer.

What the backward pass wrote is checked against what ``apply`` receives: each
gradient must be the tensor the hook saw, unchanged since (its version
counter), and the call's variables the armed ones.  A step that changed a
gradient after the backward pass (clipping by hand, a second backward pass
that accumulates into a bucket already sent) marks itself stale in the tail;
every rank then sees the mark in the same sum, sums that call again the plain
way and stops overlapping for the rest of the run, so the result is exact and
the ranks' collectives stay in step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from multigpu.backend.torch.flat import WeightedWriter

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Bucketed"]

BUCKET_BYTES = 4 << 20  # smaller than DDP's 25 MiB, so that a sum starts sooner; parallelize(bucket_mb=) sets it
FIRST_BUCKET_BYTES = 1 << 20


class Bucketed:
    """One optimizer call's gradients, summed bucket by bucket as the backward pass produces them.

    Args:
        variables: the call's variables (Keras variables on torch).
        grad_dtype: the dtype the gradients travel in (``float32``, or 16 bits with compression).
        device: where the buffers live.
        tail: float32 values sent after the gradients (flags, extras, header) at most; grows when needed.
        bucket_bytes: a bucket's size in bytes (a variable larger than it is a bucket of its own); default
            :data:`BUCKET_BYTES`.
        writer: writes weighted gradients into the buckets (shared with the plain path's sums).
    """

    def __init__(self, variables: Sequence, grad_dtype: torch.dtype, device: torch.device, tail: int,
                 bucket_bytes: int | None = None, writer: WeightedWriter | None = None) -> None:
        self.variables = list(variables)
        self.writer = writer or WeightedWriter()
        self.tensors = [v.value for v in self.variables]
        self.index = {id(t): i for i, t in enumerate(self.tensors)}
        self.grad_dtype = grad_dtype
        self.fused_tail = grad_dtype == torch.float32  # the tail rides with the last bucket
        size = torch.empty(0, dtype=grad_dtype).element_size()
        self.offsets = [0] * len(self.tensors)
        self.bucket_of = [0] * len(self.tensors)
        self.buckets: list[tuple[int, int, int]] = []  # (start, end, variables in it)
        bucket_bytes = bucket_bytes or BUCKET_BYTES
        offset, start, count, cap = 0, 0, 0, FIRST_BUCKET_BYTES
        for i in reversed(range(len(self.tensors))):
            n = self.tensors[i].numel()
            if count and (offset - start + n) * size > cap:
                self.buckets.append((start, offset, count))
                start, count, cap = offset, 0, bucket_bytes
            self.offsets[i] = offset
            self.bucket_of[i] = len(self.buckets)
            offset += n
            count += 1
        if count:
            self.buckets.append((start, offset, count))
        self.numel = offset
        self.device = device
        self.tail_capacity = tail
        self.flat = torch.empty(self.numel + (tail if self.fused_tail else 0), dtype=grad_dtype, device=device)
        self.tail_flat = None if self.fused_tail else torch.empty(tail, dtype=torch.float32, device=device)
        self.weight = 1.0
        self.armed = False
        self._reset()

    def matches(self, variables: Sequence) -> bool:
        return len(variables) == len(self.variables) and all(a is b for a, b in zip(variables, self.variables))

    def _reset(self) -> None:
        self.seen: list[tuple[torch.Tensor, int] | None] = [None] * len(self.tensors)
        self.waiting = [b[2] for b in self.buckets]
        self.launched = 0
        self.works: list = []
        self.stale = False

    # ------------------------------------------------------------ during backward
    def arm(self, weight: float) -> None:
        """Starts a step: hooks write into the buckets until :meth:`finish`."""
        self._reset()
        self.weight = float(weight)
        self.armed = True

    def on_grad(self, tensor: torch.Tensor) -> None:
        """The post-accumulate-grad hook of one of the call's variables."""
        i = self.index.get(id(tensor))
        if i is None or not self.armed:
            return
        b = self.bucket_of[i]
        if b < self.launched:  # accumulated again after its bucket was sent
            self.stale = True
            return
        grad = tensor.grad
        self._write(i, grad)
        if self.seen[i] is None:
            self.waiting[b] -= 1
        self.seen[i] = (grad, grad._version)
        self._launch_ready()

    def _write(self, i: int, grad: torch.Tensor | None) -> None:
        o = self.offsets[i]
        self.writer.write(self.flat[o : o + self.tensors[i].numel()], grad, self.weight)

    def _launch_ready(self) -> None:
        while self.launched < len(self.buckets) - 1 and self.waiting[self.launched] == 0:
            start, end, _ = self.buckets[self.launched]
            self.works.append(dist.all_reduce(self.flat[start:end], async_op=True))
            self.launched += 1

    # ------------------------------------------------------------ at optimizer.apply
    def check(self, grads: Sequence) -> bool:
        """Whether ``grads`` are exactly what the hooks wrote into the buckets."""
        if self.stale:
            return False
        for g, seen in zip(grads, self.seen):
            if seen is None:
                if g is not None:
                    return False
            elif g is not seen[0] or g._version != seen[1]:
                return False
        return True

    def finish(self, tail_values: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """Sums what is left, waits for every sum, and returns (summed gradients, summed tail)."""
        self.armed = False
        for i, seen in enumerate(self.seen):
            if seen is None and self.bucket_of[i] >= self.launched:
                self._write(i, None)
        n_tail = tail_values.numel()
        if n_tail > self.tail_capacity:
            self._grow_tail(n_tail)
        last = len(self.buckets) - 1
        while self.launched < last:
            start, end, _ = self.buckets[self.launched]
            self.works.append(dist.all_reduce(self.flat[start:end], async_op=True))
            self.launched += 1
        start = self.buckets[last][0] if self.buckets else 0
        if self.fused_tail:
            self.flat[self.numel : self.numel + n_tail].copy_(tail_values)
            self.works.append(dist.all_reduce(self.flat[start : self.numel + n_tail], async_op=True))
            tail_sum = self.flat[self.numel : self.numel + n_tail]
        else:
            if self.buckets:
                self.works.append(dist.all_reduce(self.flat[start : self.numel], async_op=True))
            self.tail_flat[:n_tail].copy_(tail_values)
            self.works.append(dist.all_reduce(self.tail_flat[:n_tail], async_op=True))
            tail_sum = self.tail_flat[:n_tail]
        self.launched = len(self.buckets)
        for work in self.works:
            work.wait()
        self.works = []
        return self.flat[: self.numel], tail_sum.tolist()

    def _grow_tail(self, n_tail: int) -> None:
        """More room for the tail (extras larger than ever before): waits for sums in flight first."""
        for work in self.works:
            work.wait()
        self.works = []
        # The launched buckets are summed by now: their sums are copied with the rest.
        self.tail_capacity = n_tail
        if self.fused_tail:
            flat = torch.empty(self.numel + n_tail, dtype=self.grad_dtype, device=self.device)
            flat[: self.numel].copy_(self.flat[: self.numel])
            self.flat = flat
        else:
            self.tail_flat = torch.empty(n_tail, dtype=torch.float32, device=self.device)
