"""The gradient path: share-weighted sums of gradients, at the optimizer's door.

Rank ``r`` computes the gradient ``g_r`` of its mean loss over its ``b_r``
rows.  The gradient of the mean loss over the global batch of ``B`` rows is
``sum_r (b_r / B) * g_r``, so every rank multiplies its gradients by
``b_r / B`` and the ranks sum them.  That is exact for any shares, ragged
batches and empty ranks (an empty rank adds zeros), and for terms that do not
depend on the batch (regularizers), since the weights sum to one.

:class:`GradientSync` does this: the built-in step calls :meth:`GradientSync.sum`
after its backward pass, then Keras's own ``apply``; for a ``train_step``
override (several optimizers, several backward passes, frozen parts), which
calls ``optimizer.apply`` itself, each optimizer is wrapped on the instance
to take the same sum first.  One collective per sum carries the gradients,
one flag per variable (a variable without a gradient on every rank keeps
``None``, as on one device: an optimizer with momentum must not see a zero
there), whatever the step attached (metric states and step timings), and a
short header that catches ranks whose calls differ.

A step's figures have one owner, the :class:`StepSums` that :meth:`GradientSync.begin_step` makes: the step's
weight ``b_r / B``, the extras and their sum, its calls, and, in a run that may lose a rank, what its updates
change, so that a step of the model's own can be put back (:meth:`GradientSync.undo`). Compression
(``"bf16"``, ``"fp16"``) sends the weighted gradients in 16 bits and the rest in float32 (weighted before the
cast). With ``overlap`` (between machines and on GPUs), from the second step on each call's gradients are
summed in buckets while the backward pass runs (:mod:`multigpu.backend.torch.overlap`), planned by the same
call's variables in the previous step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from multigpu import failure, membership
from multigpu._keras.model_parts import build_optimizer
from multigpu._warn import warn_user
from multigpu.backend.facts import HALF_PRECISION
from multigpu.backend.torch.flat import Layout, WeightedWriter, weak_hook
from multigpu.backend.torch.overlap import BUCKET_BYTES, Bucketed
from multigpu.backend.torch.streamed import StreamedGradients

__all__ = ["COMPRESSION", "GradientSync", "StepSums"]

COMPRESSION = {None: None, **{k: getattr(torch, v) for k, v in HALF_PRECISION.items()}}
_HEADER = 3
_STALE = 4  # tail[-4]: ranks whose gradients changed after their bucket was sent (overlap)
_TAG_MOD = 251  # tag and tag**2 (< 2**16) summed over up to 256 ranks stay exact in float32


@dataclass
class StepSums:
    """One training step's gradient sums: the weight of this rank's gradients (``b_r / B``, fixed for the
    step), the extras to send with the next optimizer call, and what the step's calls did and summed.

    Attributes:
        weight: ``b_r / B``.
        calls: optimizer calls so far.
        extras: float32 values to send with the next call (metric states, timings), summed as they are.
        extras_out: the sum of the last extras sent.
        log: the calls as ``(apply, variables)``, for a rank with no rows in a later step to replay.
        called: each call's variables, the plan of the next step's overlapped sums.
        kept: in a step that may be taken again, each variable its updates changed (by id) with its value
            before the step's first update of it; None otherwise.
    """

    weight: float
    calls: int = 0
    extras: torch.Tensor | None = None
    extras_out: list[float] | None = None
    log: list[tuple] = field(default_factory=list)
    called: list[list] = field(default_factory=list)
    kept: dict[int, tuple] | None = None


class GradientSync:
    """Sums share-weighted gradients over ranks inside every wrapped ``optimizer.apply``.

    Args:
        comm: the run's collectives.
        waiting: a context manager factory; time inside it counts as waiting.
        compression: ``None``, ``"bf16"`` or ``"fp16"``.
        overlap: sum gradients in buckets during the backward pass (see the module docstring).
        bucket_bytes: the buckets' size (default: :data:`~multigpu.backend.torch.overlap.BUCKET_BYTES`).
        stream_model: the model whose built-in step's gradients go into the sum's buffer during the backward
            pass and are not kept (:mod:`multigpu.backend.torch.streamed`; not with compression or overlap).
    """

    def __init__(self, comm, waiting: Callable, compression: str | None = None, overlap: bool = False,
                 bucket_bytes: int | None = None, stream_model=None) -> None:
        if compression not in COMPRESSION:
            raise ValueError(f"`compression` must be one of {sorted(map(str, COMPRESSION))}. "
                             f"Received: compression={compression!r}")
        self.comm = comm
        self.waiting = waiting
        self.compression = compression
        self.step: StepSums | None = None  # the training step running now
        self._last = StepSums(1.0)  # the step that ran last (its calls and extras stay readable after it)
        self._layouts: dict[tuple, Layout] = {}
        self.writer = WeightedWriter()
        self._unpacked: torch.Tensor | None = None  # float32, the summed 16-bit gradients read back
        self.overlap = overlap
        self.bucket_bytes = bucket_bytes or BUCKET_BYTES
        self._plans: dict[tuple, Bucketed] = {}
        self._expected: list[list] = []  # each optimizer call's variables in the previous step
        self._armed: tuple[int, Bucketed] | None = None  # (call, plan) the hooks write into
        self._hooked: dict[int, object] = {}  # id(tensor) -> its hook's handle
        self.overlapping = False  # the last step's calls were summed during the backward pass
        self._kept_values: dict[int, torch.Tensor] = {}  # id(variable) -> where a step keeps its value (keep=True)
        self.read_extras = None  # what reads the summed extras of a call that sent some, while it is set
        self.streamed = (StreamedGradients(comm, self.writer, stream_model)
                         if stream_model is not None and not overlap and not compression else None)

    # ------------------------------------------------------------ wiring
    def wrap(self, optimizer, ledger) -> None:
        """Makes ``optimizer.apply`` (and so ``apply_gradients``) sum gradients over ranks first (noted in the
        model's ``ledger``)."""
        if optimizer is None or getattr(optimizer, "_multigpu_sync", None) is self:
            return
        original = type(optimizer).apply.__get__(optimizer)
        sync = self

        def apply(grads, trainable_variables=None):
            if sync.step is None:
                return original(grads, trainable_variables)
            variables = trainable_variables
            if variables is None:
                from multigpu._keras import compat as _compat

                variables = _compat.optimizer_variables(optimizer)
            variables = list(variables)
            sync.step.log.append((original, variables))
            grads = sync.reduce(list(grads), variables)
            membership.at("update", sync.comm.rank)
            sync.keep_update(optimizer, variables)
            return original(grads, trainable_variables)

        ledger.set(optimizer, "apply", apply)
        ledger.set(optimizer, "_multigpu_sync", self)

    def begin_step(self, weight: float, keep: bool = False) -> StepSums:
        """Starts a training step whose gradients are weighted by ``weight`` (``b_r / B``): returns its sums.
        With ``keep``, what the step's updates change is kept, to put back with :meth:`undo`."""
        self.step = self._last = StepSums(float(weight), kept={} if keep else None)
        self.overlapping = False
        self._arm(0)
        if self.streamed is not None and not self.comm.alone:  # (alone: the gradients stay where they are made)
            self.streamed.arm(weight, self._layout)
        return self.step

    calls = property(lambda self: self._last.calls)
    log = property(lambda self: self._last.log)
    extras_out = property(lambda self: self._last.extras_out)

    def replay(self, calls: list[tuple]) -> None:
        """Takes part in the optimizer calls of another rank's step with no gradients of its own.

        A rank with no rows in a step cannot run a custom ``train_step`` (a
        mean over no rows is NaN); it adds zeros to the same sums instead and
        applies the result, so its weights stay equal to the others'.
        """
        for original, variables in calls:
            self.step.log.append((original, variables))
            grads = self.reduce([None] * len(variables), variables)
            self.keep_update(original.__self__, variables)
            with torch.no_grad():
                original(grads, variables)

    def keep_update(self, optimizer, variables: list) -> None:
        """Before an update of a step that keeps them: the values of ``variables`` and of the optimizer's state,
        the first time the step updates each (the optimizer is built first, as its ``apply`` would)."""
        kept = self.step.kept if self.step is not None else None
        if kept is None:
            return
        build_optimizer(optimizer, variables)
        with torch.no_grad():
            for v in (*variables, *optimizer.variables):
                if id(v) in kept:
                    continue
                value = v.value
                buf = self._kept_values.get(id(v))
                if buf is None or buf.shape != value.shape or buf.dtype != value.dtype or buf.device != value.device:
                    # Kept across steps: a fresh copy each step would pay for new pages every time.
                    buf = self._kept_values[id(v)] = torch.empty_like(value)
                buf.copy_(value)
                kept[id(v)] = (v, buf)

    def forget_kept(self) -> None:
        """The last step finished: what its updates changed is not put back any more."""
        if self._last.kept:
            self._last.kept.clear()

    def undo(self) -> None:
        """Puts back the values the last step's updates changed (kept with ``begin_step(keep=True)``)."""
        kept = self._last.kept or {}
        with torch.no_grad():
            for v, value in kept.values():
                v.value.copy_(value)
        kept.clear()

    def end_step(self) -> None:
        step, self.step = self.step, None
        self._disarm()
        if self.streamed is not None:
            self.streamed.disarm()
        if self.overlap and step is not None:
            self._expected = step.called

    # ------------------------------------------------------------ overlap
    def _arm(self, call: int) -> None:
        """Arms the plan of optimizer call ``call`` of this step (the same call's variables last step)."""
        self._disarm()
        if not self.overlap or self.step is None or call >= len(self._expected) or not self._expected[call]:
            return
        variables = self._expected[call]
        key = tuple(id(v) for v in variables)
        plan = self._plans.get(key)
        if plan is None:
            half = COMPRESSION[self.compression] or torch.float32
            plan = self._plans[key] = Bucketed(variables, half, self.comm.device, tail=len(variables) + 64,
                                               bucket_bytes=self.bucket_bytes, writer=self.writer)
            plan.tag = self._layout(variables).tag
            hook = weak_hook(self)
            for t in plan.tensors:
                if id(t) not in self._hooked and t.requires_grad:
                    self._hooked[id(t)] = t.register_post_accumulate_grad_hook(hook)
        plan.arm(self.step.weight)
        self._armed = (call, plan)

    def _disarm(self) -> None:
        if self._armed is not None:
            self._armed[1].armed = False
            self._armed = None

    def _on_grad(self, tensor: torch.Tensor) -> None:
        if self._armed is not None:
            self._armed[1].on_grad(tensor)

    def attach(self, extras: torch.Tensor) -> None:
        """Sends ``extras`` (float32, summed as they are) with the step's next optimizer call."""
        self.step.extras = extras

    # ------------------------------------------------------------ the sum
    def sum(self, grads: list, variables: list, extras: torch.Tensor | None = None
            ) -> tuple[list, list[float] | None]:
        """The share-weighted sum over ranks of ``grads`` and the plain sum of ``extras``, in one collective.

        Returns:
            The summed gradients (``None`` where no rank has one) and the summed extras (None without).
        """
        if extras is not None:
            self.attach(extras)
        grads = self.reduce(list(grads), list(variables))
        return grads, (self.step or self._last).extras_out

    def _layout(self, variables: Sequence) -> Layout:
        key = tuple((id(v), tuple(v.shape)) for v in variables)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = Layout.of(variables, _TAG_MOD)
        return layout

    def reduce(self, grads: list, variables: list) -> list:
        """The share-weighted sum over ranks of ``grads`` (``None`` where no rank has a gradient)."""
        step = self.step if self.step is not None else StepSums(1.0)
        call = step.calls
        step.calls += 1
        if self.overlap:
            step.called.append(list(variables))
        extras, step.extras = step.extras, None
        armed = self._armed
        if armed is not None and armed[0] == call:
            out = self._reduce_bucketed(step, armed[1], grads, variables, extras, call)
        else:
            out = self._reduce_whole(step, grads, variables, extras, call)
        self._arm(call + 1)
        if extras is not None and self.read_extras is not None:
            self.read_extras(step.extras_out)  # (a step of the model's own: its memory word, before any update)
        return out

    def _reduce_bucketed(self, step: StepSums, plan: Bucketed, grads: list, variables: list, extras,
                         call: int) -> list:
        """Finishes the sums the backward pass started; sums again the plain way if a rank's gradients changed."""
        self._armed = None
        n_extra = 0 if extras is None else extras.numel()
        tag = (plan.tag * 31 + call * 7 + n_extra + 3) % _TAG_MOD
        fits = plan.matches(variables)
        fresh = fits and plan.check(grads)
        head = [0.0 if (g is None or not fits) else 1.0 for g in (grads if fits else plan.variables)]
        header = [0.0 if fresh else 1.0, float(tag), float(tag * tag), 1.0]
        parts = [torch.tensor(head, dtype=torch.float32)]
        if extras is not None:
            parts.append(extras.reshape(-1).float().cpu())
        parts.append(torch.tensor(header, dtype=torch.float32))
        with self.waiting():
            with self.comm.fatal("summing gradients"):
                summed, tail = plan.finish(torch.cat(parts).to(plan.device))
        describe = lambda: (f"{len(plan.variables)} gradients in buckets and {n_extra} extra values "  # noqa: E731
                            f"in optimizer call {call + 1} of the step")
        self._check_header(tail[-3:], tag, describe)
        v = len(plan.variables)
        if extras is not None:
            step.extras_out = tail[v : v + n_extra]
        if tail[-_STALE] > 0:
            if self.overlap:
                warn_user("A training step changed its gradients between the backward pass and optimizer.apply "
                          "(or ran a second backward pass), so multigpu no longer starts the gradient sums during "
                          "the backward pass; results stay exact.")
            self.overlap = False
            self._expected = []
            return self._reduce_whole(step, grads, variables, None, call)
        self.overlapping = True
        return self._unpack(summed, tail[:v], plan.offsets, [t.shape for t in plan.tensors],
                            [t.dtype for t in plan.tensors], summed.device)

    def _reduce_whole(self, step: StepSums, grads: list, variables: list, extras, call: int) -> list:
        """One collective for the call's weighted gradients and its tail, after the backward pass."""
        layout = self._layout(variables)
        n_extra = 0 if extras is None else extras.numel()
        tag = (layout.tag * 31 + call * 7 + n_extra) % _TAG_MOD
        half = COMPRESSION[self.compression]
        n_grad, v = layout.numel, layout.variables
        # float32 message: [grads (unless compressed) | used flags | extras | header]; streamed: grads written
        flat, head = (self.streamed.take(v + n_extra + 3) if self.streamed is not None and
                      self.streamed.armed_for(layout) else (None, [0.0 if g is None else 1.0 for g in grads]))
        if self.comm.alone and step.weight == 1.0 and half is None and flat is None:  # one rank: nothing to sum
            step.extras_out = None if extras is None else extras.reshape(-1).float().tolist()
            return list(grads)
        header = [float(tag), float(tag * tag), 1.0]
        if extras is None:  # the tail in one copy (element writes cost microseconds each)
            tail_values = torch.tensor(head + header, dtype=torch.float32)
        else:
            tail_values = torch.cat([torch.tensor(head, dtype=torch.float32), extras.reshape(-1).float(),
                                     torch.tensor(header, dtype=torch.float32)])
        describe = lambda: layout.describe(n_extra, call)  # noqa: E731
        if half is None:
            if flat is None:
                flat = self.comm.buffer(n_grad + tail_values.numel(), torch.float32)
                self._fill(flat[:n_grad], grads, layout, step.weight)
            flat[n_grad:].copy_(tail_values)
            with self.waiting():
                summed = self.comm.reduce(flat, tag=tag, what="summing gradients", describe=describe)
            summed_grads = summed
            tail = summed[n_grad:].tolist()
            self._check_header(tail[-3:], tag, describe)
        else:
            # One buffer of the collectives at a time (a shared-memory buffer is this rank's slot, whatever
            # its dtype): the float32 tail is summed first, then the 16-bit gradients.
            flat = self.comm.buffer(tail_values.numel(), torch.float32)
            flat.copy_(tail_values)
            with self.waiting():
                tail = self.comm.reduce(flat, tag=tag + 1, what="summing gradients", describe=describe).tolist()
            self._check_header(tail[-3:], tag, describe)
            grads_part = self.comm.buffer(n_grad, half)
            self._fill(grads_part, grads, layout, step.weight)
            with self.waiting():
                summed_grads = self.comm.reduce(grads_part, tag=tag, what="summing gradients", describe=describe)
        if extras is not None:
            step.extras_out = tail[v : v + n_extra]
        return self._unpack(summed_grads, tail[:v], layout.offsets, layout.shapes, layout.dtypes, flat.device)

    def _unpack(self, summed_grads: torch.Tensor, flags: list[float], offsets: list[int], shapes: list,
                dtypes: list, device: torch.device) -> list:
        """The summed gradients as tensors of their variables' shapes and dtypes (``None`` where unused)."""
        n_grad = summed_grads.numel()
        unpacked = None
        if summed_grads.dtype != torch.float32 and all(d == torch.float32 for d in dtypes):
            # Read back into one kept float32 buffer: a new tensor per gradient costs its pages' first touch
            # (121 ms against 18 ms for 41M values on one core).
            if self._unpacked is None or self._unpacked.numel() < n_grad or self._unpacked.device != device:
                self._unpacked = torch.empty(n_grad, dtype=torch.float32, device=device)
            unpacked = self._unpacked
        out = []
        for i, (o, shape, dtype) in enumerate(zip(offsets, shapes, dtypes)):
            if flags[i] < 0.5:
                out.append(None)
                continue
            g = summed_grads[o : o + shape.numel()]
            if g.dtype == dtype:
                out.append(g.view(shape))
            elif unpacked is not None:
                out.append(unpacked[o : o + shape.numel()].copy_(g).view(shape))
            else:
                out.append(g.view(shape).to(dtype))
        return out

    def _fill(self, target: torch.Tensor, grads: list, layout: Layout, weight: float) -> None:
        """Writes every gradient times ``weight`` into ``target`` (zeros for a missing one)."""
        for g, o, shape in zip(grads, layout.offsets, layout.shapes):
            self.writer.write(target[o : o + shape.numel()], g, weight)

    def _check_header(self, got: list[float], tag: int, describe) -> None:
        world = float(1 if self.comm.alone else len(self.comm.among or self.comm.members))  # the ranks summed
        if got[2] != world or got[0] != world * tag or got[1] != world * tag * tag:
            from multigpu.engine.shm import CollectiveMismatchError
            failure.fail(str(CollectiveMismatchError(
                f"the ranks' optimizer calls did not match: this rank summed {describe()}, and another rank "
                "something else. Every rank must call the optimizer on the same variables the same number "
                "of times per step.")))
