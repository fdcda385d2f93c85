"""Gradients written into the sum's buffer while the backward pass makes them, and not kept (``shard="gradients"``).

Each variable's tensor carries a post-accumulate-grad hook.  When the backward
pass has accumulated a variable's gradient, the hook writes ``weight * grad``
into the variable's place in the buffer of the step's one collective (this
rank's slot of the shared-memory segment, or the buffer gloo sums in place)
and lets go of the gradient.  So a rank never holds its whole gradient beside
that buffer: one copy of the gradients less than writing them after the pass
(PyTorch's pattern for an optimizer step inside the backward pass; DDP's
``gradient_as_bucket_view`` saves the same copy).  The multiplication is the
one :class:`~multigpu.backend.torch.flat.WeightedWriter` does after the pass,
so the sum is the same, bit for bit.

Only the built-in step streams: a ``train_step`` of the model's own reads its
gradients after the backward pass, so they are kept there.  Not with global
BatchNorm statistics (their collectives run inside the backward pass, and
take the same buffer), compression (16-bit buffers) or sums started during
the backward pass (:mod:`.overlap`, which writes into its own buckets).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from multigpu.backend.torch.flat import Layout, WeightedWriter, weak_hook

__all__ = ["StreamedGradients"]


class StreamedGradients:
    """The gradients of one optimizer call streamed into the collective's buffer (see the module docstring).

    Args:
        comm: the run's collectives (its :meth:`buffer` is written into).
        writer: writes weighted gradients (shared with the plain path's sums).
        model: the model whose trainable variables' gradients are streamed.
    """

    def __init__(self, comm, writer: WeightedWriter, model) -> None:
        self.comm = comm
        self.writer = writer
        self.model = model
        self._hooked: dict[int, object] = {}  # id(tensor) -> its hook's handle
        self._tail = 0  # the tail's length last step: the buffer is asked for at its full size before the pass
        self._armed: _Armed | None = None

    def arm(self, weight: float, layout_of: Callable[[list], Layout]) -> None:
        """At a training step's start: the gradients of the model's trainable variables go into the buffer of the
        next sum, times ``weight`` (``layout_of`` gives their :class:`~multigpu.backend.torch.flat.Layout`)."""
        variables = list(self.model.trainable_weights)
        layout = layout_of(variables)
        flat = self.comm.buffer(layout.numel + (self._tail or len(layout.offsets) + 64), torch.float32)
        tensors = [v.value for v in variables]
        self._armed = _Armed(layout, {id(t): i for i, t in enumerate(tensors)}, flat, float(weight),
                             [False] * len(tensors))
        hook = weak_hook(self)
        for t in tensors:
            if id(t) not in self._hooked and t.requires_grad:
                self._hooked[id(t)] = t.register_post_accumulate_grad_hook(hook)

    def disarm(self) -> None:
        self._armed = None

    def armed_for(self, layout: Layout) -> bool:
        return self._armed is not None and self._armed.layout is layout

    def take(self, tail: int) -> tuple[torch.Tensor, list[float]]:
        """After the backward pass: the buffer of ``layout.numel + tail`` values with the gradients written (zeros
        where none came) and each variable's flag (1.0: it had a gradient); disarms."""
        armed, self._armed = self._armed, None
        layout, n_grad = armed.layout, armed.layout.numel
        self._tail = tail
        flat = self.comm.buffer(n_grad + tail, torch.float32)
        if flat.data_ptr() != armed.flat.data_ptr():  # another size than last step's: the buffer moved
            flat[:n_grad].copy_(armed.flat[:n_grad])
        for i, written in enumerate(armed.written):
            if not written:
                o = layout.offsets[i]
                flat[o : o + layout.shapes[i].numel()].zero_()
        return flat, [1.0 if w else 0.0 for w in armed.written]

    def _on_grad(self, tensor: torch.Tensor) -> None:
        armed = self._armed
        i = None if armed is None else armed.index.get(id(tensor))
        if i is None or tensor.grad is None:
            return
        o, shape = armed.layout.offsets[i], armed.layout.shapes[i]
        self.writer.write(armed.flat[o : o + shape.numel()], tensor.grad, armed.weight)
        armed.written[i] = True
        tensor.grad = None


class _Armed:
    """One armed call: its layout, each tensor's index, the buffer, the weight, what was written."""

    __slots__ = ("flat", "index", "layout", "weight", "written")

    def __init__(self, layout: Layout, index: dict[int, int], flat: torch.Tensor, weight: float,
                 written: list[bool]) -> None:
        self.layout, self.index, self.flat, self.weight, self.written = layout, index, flat, weight, written
