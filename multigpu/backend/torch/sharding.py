"""The optimizer's state sharded over the ranks (``parallelize(..., shard_optimizer=True)``; ZeRO stage 1).

Each variable's optimizer state (Adam's moments, a momentum, gradient
accumulators) lives on one rank, its owner (:mod:`multigpu.planning.partition`:
parts follow each device's memory).  Every rank holds the whole summed
gradient after the step's sum; the owner of a variable alone applies Keras's
own update to it, and one sum of the new values (each rank adds the values it
owns and zeros elsewhere: exact, since ``x + 0 == x``) gives every rank every
weight.  So every rank holds the same weights after every step, as without
sharding, and the update runs once instead of once per rank.

What is kept exact, and how:

* the update is Keras's own ``_backend_apply_gradients`` on the owned
  variables: clipnorm, clipvalue, weight decay, schedules, gradient
  accumulation and the optimizer's own update run per variable as on one
  device; constraints and the iteration count run after the new weights
  are everywhere, on every rank, as Keras runs them;
* ``global_clipnorm`` needs the norm over every gradient: each rank has them
  all, so it clips them all with Keras's own function before the owned update
  (with gradient accumulation the norm would be over accumulators that only
  owners hold: that combination is refused);
* EMA averages stay whole on every rank and are updated after the new weights
  arrive, as Keras does after its update;
* a ``LossScaleOptimizer`` decides on the whole gradient (the same on every
  rank), and its inner optimizer is the one sharded.

Saving gathers the whole state (:meth:`ShardedOptimizers.whole`, on every
rank, around the parallel model's ``save``/``save_weights``), so a file holds
what one device would write; loading fills every rank's whole state from the
file, and the parts not owned are let go again at the next update.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence

import torch

from multigpu._keras import compat as _compat
from multigpu.planning.partition import memory_weights, owners, parts

__all__ = ["ShardedOptimizers", "device_memory"]


def device_memory(devices) -> list[int | None]:
    """Each device's memory in bytes where known: a CPU device's given size, a GPU's total memory."""
    out: list[int | None] = []
    for d in devices:
        if d.memory is not None:
            out.append(int(d.memory))
        elif d.is_cuda and torch.cuda.is_available():
            out.append(int(torch.cuda.get_device_properties(d.index).total_memory))
        else:
            out.append(None)
    return out


class _Shard:
    """One optimizer's partition: the owner of each variable it was built with, and its state per variable."""

    def __init__(self, optimizer, variables: Sequence, weights: Sequence[float], rank: int) -> None:
        self.optimizer = optimizer
        self.variables = list(variables)
        sizes = [int(v.value.numel()) for v in self.variables]
        self.owner = owners(sizes, weights)
        self.rank = rank
        self.parts = parts(sizes, self.owner, len(weights))
        self.mine = {id(v) for v, o in zip(self.variables, self.owner) if o == rank}
        self.dropped = False

    def slots(self) -> list[tuple[object, object]]:
        """``(state variable, its model variable)`` for every sharded state variable (EMA averages excluded)."""
        out = []
        for values in _compat.optimizer_slot_lists(self.optimizer):
            out += [(s, v) for s, v in zip(values, self.variables) if s is not None]
        return out

    def drop(self) -> None:
        """Lets go of the state of the variables this rank does not own."""
        for slot, variable in self.slots():
            if id(variable) not in self.mine:
                _compat.set_variable_storage(slot, _storage(torch.empty(0, dtype=slot.value.dtype,
                                                                        device=slot.value.device)))
        self.dropped = True

    def zeros(self) -> None:
        """Room again for the whole state (zeros where this rank does not own it)."""
        for slot, variable in self.slots():
            if id(variable) not in self.mine and slot.value.numel() != variable.value.numel():
                _compat.set_variable_storage(slot, _storage(torch.zeros(tuple(slot.shape), dtype=slot.value.dtype,
                                                                        device=variable.value.device)))
        self.dropped = False


class ShardedOptimizers:
    """The sharded optimizers of one parallel model (torch).

    Args:
        comm: the run's collectives.
        ledger: the model's ledger (notes what is set on the optimizers).
        weights: each rank's share of the state (from the devices' memory; equal where unknown).
    """

    def __init__(self, comm, ledger, weights: Sequence[float] | None = None) -> None:
        self.comm = comm
        self.ledger = ledger
        self.weights = list(weights) if weights is not None else memory_weights(device_memory(comm.runtime.devices))
        self._shards: dict[int, _Shard] = {}  # by id of the optimizer that holds the state

    @staticmethod
    def holder(optimizer):
        """The optimizer that holds the state: a ``LossScaleOptimizer``'s inner one, else itself."""
        return getattr(optimizer, "inner_optimizer", None) or optimizer

    # ------------------------------------------------------------ wiring
    def see(self, optimizer) -> None:
        """Takes ``optimizer`` in (once): its update runs on the owned variables, its state is sharded once it
        is built (at once if it is), and loading fills the whole state."""
        inner = self.holder(optimizer)
        if inner is None or getattr(inner, "_multigpu_sharded", None) is self:
            return
        if inner.gradient_accumulation_steps and inner.global_clipnorm:
            raise ValueError(
                "shard_optimizer=True cannot take an optimizer with both `gradient_accumulation_steps` and "
                "`global_clipnorm`: the norm is over accumulated gradients that only their owners hold. "
                f"Received: gradient_accumulation_steps={inner.gradient_accumulation_steps}, "
                f"global_clipnorm={inner.global_clipnorm}. Use shard_optimizer=False, or clipnorm.")
        keras_apply = _compat.backend_apply_gradients(inner)
        shards = self

        def sharded_apply(opt, grads, variables):
            shards._apply(opt, keras_apply, list(grads), list(variables))

        self.ledger.set(inner, "_multigpu_sharded", self)
        self.ledger.set(inner, "_backend_apply_gradients", types.MethodType(sharded_apply, inner))
        self.ledger.set(inner, "_backend_reset_gradient_accumulators",
                        types.MethodType(_compat.reset_held_accumulators, inner))
        for holder in {id(o): o for o in (optimizer, inner)}.values():
            self._load_whole(holder)
        if inner.built:
            self._shard(inner)

    def prepare(self, optimizer, variables: Sequence) -> None:
        """Builds ``optimizer`` for ``variables`` with only the owned state (before Keras would build it
        whole): the parts not owned never take memory."""
        self.see(optimizer)
        inner = self.holder(optimizer)
        if optimizer.built or not variables:
            return
        shard = _Shard(inner, variables, self.weights, self.comm.rank)
        keras_add = type(inner).add_variable_from_reference.__get__(inner)

        def add_variable_from_reference(opt, reference_variable, name=None, initializer="zeros"):
            if id(reference_variable) in shard.mine or name == "average":  # EMA averages stay whole
                return keras_add(reference_variable, name=name, initializer=initializer)
            return keras_add(reference_variable, name=name,
                             initializer=lambda shape, dtype=None: torch.empty(0, dtype=getattr(
                                 reference_variable.value, "dtype", torch.float32)))

        # For this build only: not noted in the ledger, and gone again before anything else runs.
        object.__setattr__(inner, "add_variable_from_reference", types.MethodType(add_variable_from_reference, inner))
        try:
            optimizer.build(list(variables))
        finally:
            object.__delattr__(inner, "add_variable_from_reference")
        shard.dropped = True
        self._shards[id(inner)] = shard

    def _load_whole(self, optimizer) -> None:
        keras_load = type(optimizer).load_own_variables.__get__(optimizer)
        shards = self

        def load_own_variables(opt, store):
            shard = shards._shards.get(id(shards.holder(opt)))
            if shard is not None and shard.dropped:
                shard.zeros()  # the file has the whole state: every rank reads it, and lets go of parts later
            return keras_load(store)

        self.ledger.set(optimizer, "load_own_variables", types.MethodType(load_own_variables, optimizer))

    def _shard(self, inner) -> _Shard:
        shard = self._shards.get(id(inner))
        if shard is None:
            shard = self._shards[id(inner)] = _Shard(inner, _compat.optimizer_variables(inner), self.weights,
                                                     self.comm.rank)
        if not shard.dropped:
            shard.drop()
        return shard

    # ------------------------------------------------------------ the update
    def _apply(self, opt, keras_apply, grads: list, variables: list) -> None:
        shard = self._shard(opt)
        if opt.global_clipnorm and opt.global_clipnorm > 0 and not opt.clipnorm:
            grads = _compat.clip_by_global_norm(grads, opt.global_clipnorm)  # over every gradient, as Keras would
        update = True
        if opt.gradient_accumulation_steps:
            steps = opt.gradient_accumulation_steps  # Keras updates when (iterations + 1) % steps == 0
            update = (_compat.applied_steps(opt) + 1) % steps == 0
        owned = [i for i, v in enumerate(variables) if id(v) in shard.mine]
        with _keras_features_off(opt):
            if owned:
                keras_apply([grads[i] for i in owned], [variables[i] for i in owned])
        if update:
            self._share(shard, variables)
        if opt.use_ema:
            _compat.update_ema(opt)

    def _share(self, shard: _Shard, variables: list) -> None:
        """Every rank's owned new values on every rank."""
        self._sum_owned([(v.value, v) for v in variables], shard, 7, "the updated weights")

    def _sum_owned(self, pairs: list[tuple[torch.Tensor, object]], shard: _Shard, tag: int, what: str) -> None:
        """Each rank's tensors of the model variables it owns on every rank: one collective per dtype whose
        every element one rank writes (on shared memory straight into the result; elsewhere a sum of vectors
        that are zero where a rank does not own: exact, ``x + 0 == x``); the others' tensors are copied in."""
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, bool]]] = {}
        for tensor, variable in pairs:
            by_dtype.setdefault(tensor.dtype, []).append((tensor, id(variable) in shard.mine))
        for dtype, group in by_dtype.items():
            n = sum(int(t.numel()) for t, _ in group)
            buf = self.comm.buffer(n, dtype, disjoint=True)
            offset = 0
            with torch.no_grad():
                for tensor, mine in group:
                    size = int(tensor.numel())
                    if mine:
                        buf[offset : offset + size].copy_(tensor.reshape(-1))
                    offset += size
                layout = f"{what} ({n} values of {dtype})"
                summed = self.comm.reduce(buf, tag=tag, what=f"sharing {what}", describe=lambda layout=layout: layout)
                offset = 0
                for tensor, mine in group:
                    size = int(tensor.numel())
                    if not mine:
                        tensor.copy_(summed[offset : offset + size].view_as(tensor))
                    offset += size

    # ------------------------------------------------------------ whole state
    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every sharded optimizer's whole state on every rank (a collective), then sharded again."""
        self.gather()
        try:
            yield
        finally:
            for shard in self._shards.values():
                shard.drop()

    def gather(self) -> None:
        """Every sharded optimizer's whole state on every rank (a collective); it stays whole until the next
        update shards it again."""
        for shard in self._shards.values():
            if shard.dropped:
                shard.zeros()
                self._sum_owned([(slot.value, variable) for slot, variable in shard.slots()], shard, 8,
                                "the optimizer's state")


def _storage(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


@contextlib.contextmanager
def _keras_features_off(opt) -> Iterator[None]:
    """Keras's update without what :class:`ShardedOptimizers` does over every variable itself: the global
    norm's clipping (done on every gradient before) and the EMA (after the new weights are everywhere)."""
    saved = opt.global_clipnorm, opt.use_ema
    opt.global_clipnorm, opt.use_ema = None, False
    try:
        yield
    finally:
        opt.global_clipnorm, opt.use_ema = saved
