"""The weights in parts while ``fit`` runs (``parallelize(..., shard="weights")``; ZeRO stage 3) on torch.

Each trainable weight belongs to one rank, the owner of its optimizer state
(:mod:`multigpu.planning.partition`: parts follow each device's memory).
While ``fit`` runs, a rank holds the weights it owns and lets go of the
others (the ``torch.nn.Parameter`` keeps its identity, hooks and Keras
shape; its ``.data`` holds no elements).  A layer's weights come back just
for its ``call``, and again just before the backward pass reaches the
layer, and go when it is done:

1. forward: the layer's ``call`` (wrapped, noted in the model's ledger)
   first gathers the layer's weights it does not hold, runs, and lets them
   go; in a pass that builds a graph, each output the backward pass will
   reach carries a hook;
2. backward: the first of those hooks to fire (the gradient of the layer's
   output is there, its own backward not yet run) gathers the weights
   again, in the same ``Parameter`` objects the graph saved; each weight
   goes once its gradient is accumulated (a post-accumulate hook, after
   which no part of the graph reads it);
3. the gradients are summed as with ``shard="gradients"``
   (:mod:`.streamed`) and each owner updates its own weights (Keras's own
   update, :mod:`multigpu.backend.sharding`); the new values reach nobody
   until a pass gathers them.

A gather is one collective per dtype in which each owner writes its values
(on shared memory straight into the result, elsewhere a sum with zeros
elsewhere, exact).  Every rank runs the same layers in the same order, so
the gathers match; a rank with no rows runs its passes on no rows.  The
collectives carry the layer's layout as their tag: a mismatch is an error
naming both sides, never wrong weights.

What stays whole on every rank: non-trainable weights, a weight with a
regularizer or a constraint (Keras reads those outside the layer's call) and
a weight no layer holds as its own.  The weights stay in parts from the
first ``fit`` on (``evaluate`` and ``predict`` gather a layer's for its
call, as training does); the parallel model's ``save``, ``save_weights``,
``get_weights``, ``set_weights`` and ``load_weights`` (and so
``ModelCheckpoint`` and ``BackupAndRestore``) gather them all for the call
(:meth:`WeightsInParts.whole`: a collective, every rank calls it), and
``unparallelize`` gathers them for good (:meth:`WeightsInParts.end`).  The
first step's calibration of automatic shares runs on the whole weights.

A gather's values go into room kept from an earlier gather of that size
when nothing else holds it (at most the largest layer's worth): new
pages at every gather ran the 29.4M-weight model of
``benchmarks/optimizer_sharding/`` at 175.8 samples/s, kept room at 247.7.
Room of which an autograd graph still holds a view goes with the graph
instead (:func:`.internals.storage_uses`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Iterator

import keras
import torch

from multigpu._keras import compat as _compat
from multigpu.backend.torch import internals

__all__ = ["WeightsInParts", "parted_candidates"]

_TAG_BASE = 40_000


def parted_candidates(model) -> dict[int, object]:
    """Each layer's own trainable variables that may be in parts, by id: those with neither regularizer nor
    constraint (Keras reads those outside the layer's ``call``), once each."""
    out: dict[int, object] = {}
    for layer in _layers(model):
        for v in _own_trainable(layer):
            if getattr(v, "regularizer", None) is None and getattr(v, "constraint", None) is None:
                out.setdefault(id(v), layer)
    return out


def _layers(model) -> list:
    return [model, *_compat.flatten_layers(model)]


def _own_trainable(layer) -> list:
    return _compat.own_trainable_variables(layer)


class _Group:
    """One layer's variables in parts, and which of them this rank owns."""

    __slots__ = ("index", "layer", "mine", "variables")

    def __init__(self, index: int, layer, variables: list, mine: list[bool]) -> None:
        self.index, self.layer, self.variables, self.mine = index, layer, variables, mine


class WeightsInParts:
    """The weights of one parallel model in parts while ``fit`` runs (see the module docstring).

    Args:
        comm: the run's collectives.
        ledger: the model's ledger (notes the layers' wrapped ``call``).
        model: the model.
    """

    def __init__(self, comm, ledger, model) -> None:
        self.comm = comm
        self.ledger = ledger
        self.model = model
        self.active = False
        self.groups: list[_Group] = []  # one a layer holding weights in parts
        self._mine: dict[int, bool] = {}  # id(variable) -> whether this rank owns it
        self._tensor: dict[int, torch.Tensor] = {}  # id(variable) -> its torch Parameter
        self._by_layer: dict[int, _Group] = {}  # id(layer) -> its group
        self._by_tensor: dict[int, object] = {}  # id(torch tensor) -> its variable
        self._present: set[int] = set()  # the variables in parts whose values every rank holds now
        self._shapes: dict[int, tuple] = {}
        self._hooked: set[int] = set()
        self._calls = 0  # the shared-memory sums run when the step began
        self._lent: dict[int, torch.Tensor] = {}  # id(variable) -> the room its gathered values are in
        self._pool: dict[tuple, list[torch.Tensor]] = {}  # (values, dtype) -> rooms given back, for the next gather
        self._pooled = 0  # bytes in the pool
        self._largest = 0  # bytes of the largest layer's weights not owned here
        self.held = 0  # bytes of weights not owned held now
        self.peak = 0  # the most bytes of weights not owned held at once (and rooms kept for them) since fit began
        self.owned_bytes = 0
        self.total_bytes = 0

    # ------------------------------------------------------------ fit
    def begin(self, variables: list, owner: list[int]) -> None:
        """From ``fit``'s start: each of ``variables`` (the optimizer's, in its order) that may be in parts is
        held by its ``owner`` alone (``owner``: the optimizer state's partition)."""
        from multigpu.throttle import map_large_blocks

        map_large_blocks()  # (a layer's weights come and go twice a step: their memory goes back each time)
        candidates = parted_candidates(self.model)
        rank = self.comm.rank
        by_layer: dict[int, list] = {}
        layer_of: dict[int, object] = {}
        for v, o in zip(variables, owner):
            layer = candidates.get(id(v))
            if layer is not None:
                by_layer.setdefault(id(layer), []).append((v, o == rank))
                layer_of[id(layer)] = layer
        self.groups, self._by_layer, self._by_tensor = [], {}, {}
        for key, pairs in by_layer.items():
            group = _Group(len(self.groups), layer_of[key], [v for v, _ in pairs], [m for _, m in pairs])
            self.groups.append(group)
            self._by_layer[key] = group
            for v, m in zip(group.variables, group.mine):
                self._mine[id(v)] = m
                tensor = self._tensor[id(v)] = v.value  # the Parameter itself (in a layer's call, a mixed
                # precision policy's value is a cast copy)
                self._by_tensor[id(tensor)] = v
                if id(tensor) not in self._hooked:
                    self._hooked.add(id(tensor))
                    tensor.register_post_accumulate_grad_hook(functools.partial(_accumulated, weakref.ref(self)))
                self._shapes[id(v)] = tuple(int(d) for d in v.shape)
            self._wrap(group.layer)
        self.total_bytes = sum(_bytes(self._tensor[id(v)], self._shapes[id(v)]) for g in self.groups
                               for v in g.variables)
        self.owned_bytes = sum(_bytes(self._tensor[id(v)], self._shapes[id(v)]) for g in self.groups
                               for v, m in zip(g.variables, g.mine) if m)
        self._present = {id(v) for g in self.groups for v in g.variables}
        self.held = self.total_bytes - self.owned_bytes
        self._largest = max((sum(_bytes(self._tensor[id(v)], self._shapes[id(v)])
                                 for v, m in zip(g.variables, g.mine) if not m) for g in self.groups), default=0)
        self.active = True
        self.release_all()
        self.peak = 0

    def end(self) -> None:
        """Every weight on every rank from now on, not in parts (a collective: ``unparallelize``)."""
        if not self.active:
            return
        for group in self.groups:
            self.gather(group)
        self.active = False
        self._lent, self._pool, self._pooled = {}, {}, 0

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every weight on every rank for the block, in parts again after it (a collective: a save, ``get_weights``,
        a load, the first step's calibration)."""
        if not self.active:
            yield
            return
        for group in self.groups:
            self.gather(group)
        self.active = False  # (the layers' calls and hooks leave the weights alone meanwhile)
        try:
            yield
        finally:
            self.active = True
            self.release_all()

    def begin_step(self) -> None:
        """A training step begins (before its gradients' buffer is taken)."""
        self._calls = self.comm.calls()

    def end_step(self) -> None:
        """A training step ended everywhere: an odd number of collectives in it (the gathers, the sum) is made even
        with an empty one, so that every step's gradients go into the same one of shared memory's two sets of
        buffers (each set's pages are memory the machine holds: alternating sets held both)."""
        if self.active and (self.comm.calls() - self._calls) % 2:
            buf = self.comm.buffer(1, torch.float32, disjoint=True)
            if self.comm.rank == self.comm.leader:
                buf.zero_()
            self.comm.reduce(buf, tag=_TAG_BASE - 1, what="evening out a step's collectives")

    def report(self) -> dict:
        """This rank's figures: the weights in parts' bytes, those it owns, and the most it held of the
        others' at once."""
        return {"total": self.total_bytes, "owned": self.owned_bytes, "peak": self.peak}

    # ------------------------------------------------------------ gathering and letting go
    def gather(self, group: _Group) -> None:
        """The group's weights not present everywhere now, from their owners to every rank (a collective)."""
        wanted = [(v, m) for v, m in zip(group.variables, group.mine) if id(v) not in self._present]
        if not wanted:
            return
        by_dtype: dict[torch.dtype, list] = {}
        for v, m in wanted:
            by_dtype.setdefault(self._tensor[id(v)].dtype, []).append((v, m))
        with torch.no_grad():
            for dtype, pairs in by_dtype.items():
                sizes = [math.prod(self._shapes[id(v)]) for v, _ in pairs]
                n = sum(sizes)
                if self.comm.transport == "shm":
                    buf = self.comm.buffer(n, dtype, disjoint=True)
                else:  # gloo, NCCL: a buffer of its own (the step's sum keeps its buffers meanwhile), zeros
                    buf = torch.zeros(n, dtype=dtype, device=self.comm.device)
                offset = 0
                for (v, m), size in zip(pairs, sizes):
                    if m:
                        buf[offset : offset + size].copy_(self._tensor[id(v)].detach().reshape(-1))
                    offset += size
                tag = _TAG_BASE + (group.index * 131 + n) % 20_000
                summed = self.comm.reduce(
                    buf, tag=tag, what="gathering a layer's weights",
                    describe=lambda group=group, n=n: f"the weights of layer {group.layer.name!r} ({n} values)")
                offset = 0
                for (v, m), size in zip(pairs, sizes):
                    if not m:
                        flat = self._take(size, dtype)
                        flat.copy_(summed[offset : offset + size])
                        self._lent[id(v)] = flat
                        self._tensor[id(v)].data = flat.view(self._shapes[id(v)])
                        self.held += size * summed.element_size()
                    offset += size
                    self._present.add(id(v))
        self.peak = max(self.peak, self.held + self._pooled)

    def release(self, variable) -> None:
        """Lets go of ``variable``'s values on every rank but its owner (no collective)."""
        key = id(variable)
        if key not in self._present:
            return
        self._present.discard(key)
        if not self._mine[key]:
            value = self._tensor[key]
            self.held -= value.numel() * value.element_size()
            value.data = torch.empty(0, dtype=value.dtype, device=value.device)
            flat = self._lent.pop(key, None)
            if flat is not None:
                self._give_back(flat)

    def _take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``n`` values' room: one given back before (no new pages to touch, the largest cost of a gather: a
        layer's weights come twice a step), else new."""
        kept = self._pool.get((n, dtype))
        if kept:
            flat = kept.pop()
            self._pooled -= flat.numel() * flat.element_size()
            return flat
        return torch.empty(n, dtype=dtype, device=self.comm.device)

    def _give_back(self, flat: torch.Tensor) -> None:
        """Keeps ``flat`` for the next gather of its size when nothing else holds it (a view of it in an
        autograd graph: it goes with the graph) and the pool stays within the largest layer: a room kept
        beside the largest layer's gather would raise the peak, which that gather and its gradient set."""
        size = flat.numel() * flat.element_size()
        if internals.storage_uses(flat) != 1 or self._pooled + size > self._largest:
            return
        self._pool.setdefault((flat.numel(), flat.dtype), []).append(flat)
        self._pooled += size

    def release_all(self) -> None:
        """Lets go of every weight not owned (after a step's passes)."""
        for group in self.groups:
            for v in group.variables:
                self.release(v)

    # ------------------------------------------------------------ the layers' passes
    def _wrap(self, layer) -> None:
        if getattr(layer, "_multigpu_parts", None) is self:
            return
        keras_call = layer.call
        parts = self

        @functools.wraps(keras_call)
        def call(*args, **kwargs):
            group = parts._by_layer.get(id(layer))
            if not parts.active or group is None:
                return keras_call(*args, **kwargs)
            if _compat.in_symbolic_scope():  # shapes only (Keras's build): zeros stand in, no collective
                with parts._stand_ins(group):
                    return keras_call(*args, **kwargs)
            parts.gather(group)
            try:
                out = keras_call(*args, **kwargs)
            finally:
                for v in group.variables:
                    if not (torch.is_grad_enabled() and parts._tensor[id(v)].requires_grad):
                        parts.release(v)
            if torch.is_grad_enabled():
                parts._hook_backward(group, out)
            return out

        self.ledger.set(layer, "_multigpu_parts", self)
        self.ledger.set(layer, "call", call)

    @contextlib.contextmanager
    def _stand_ins(self, group: _Group) -> Iterator[None]:
        absent = [v for v in group.variables if not self._mine[id(v)] and id(v) not in self._present]
        for v in absent:
            t = self._tensor[id(v)]
            t.data = torch.zeros(self._shapes[id(v)], dtype=t.dtype, device=t.device)
        try:
            yield
        finally:
            for v in absent:
                t = self._tensor[id(v)]
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def _hook_backward(self, group: _Group, out) -> None:
        """Lets go of the group's weights now; they come back when the backward pass reaches the layer's
        outputs, and go again once their gradients are accumulated."""
        tensors = [t for t in keras.tree.flatten(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        ref = weakref.ref(self)
        for t in tensors:
            t.register_hook(functools.partial(_before_backward, ref, group))
        for v in group.variables:
            self.release(v)


def _before_backward(ref, group: _Group, grad) -> None:
    """The backward pass reached a layer's output: its weights back first."""
    parts = ref()
    if parts is not None and parts.active:
        parts.gather(group)


def _accumulated(ref, tensor: torch.Tensor) -> None:
    """A weight's gradient is accumulated: no part of the graph reads it any more."""
    parts = ref()
    if parts is not None and parts.active:
        variable = parts._by_tensor.get(id(tensor))
        if variable is not None:
            parts.release(variable)


def _bytes(tensor: torch.Tensor, shape: tuple) -> int:
    return math.prod(shape) * tensor.element_size()
