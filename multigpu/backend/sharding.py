"""The optimizer's state in parts over the ranks (``parallelize(..., shard_optimizer=True)``; ZeRO stage 1), once
for every backend whose optimizers hold their state in variables (torch, TensorFlow).

Each variable's optimizer state (Adam's moments, a momentum, gradient
accumulators) lives on one rank, its owner (:mod:`multigpu.planning.partition`:
parts follow each device's memory where it is known, a GPU's or a size given
as ``cpu:0/8GiB``; elsewhere the parts are equal).  Every rank holds the whole summed
gradient after the step's sum; the owner of a variable alone applies Keras's
own update to it, and one collective of the new values (each rank writes the
values it owns; a sum with zeros elsewhere, exact since ``x + 0 == x``) gives
every rank every weight.  So every rank holds the same weights after every
step, as without parts, and the update runs once instead of once per rank.

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
  rank), and its inner optimizer is the one in parts.

Saving gathers the whole state (:meth:`ShardedOptimizers.whole`, on every
rank, around the parallel model's ``save``/``save_weights``), so a file holds
what one device would write; loading fills every rank's whole state from the
file, and the parts not owned are let go again before the next update
(:meth:`ShardedOptimizers.before_step`).

A backend gives the storage of a state variable (:meth:`ShardedOptimizers.resize`,
:meth:`ShardedOptimizers.empty`) and the collective of the owned values
(:meth:`ShardedOptimizers.sum_owned`); the JAX backend, whose optimizer state
is a value passed through a compiled step, keeps its own
(:mod:`multigpu.backend.jax.sharding`) over the same partition.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator, Sequence

from multigpu._keras import compat as _compat
from multigpu._keras.model_parts import optimizer_slots
from multigpu.planning.partition import memory_weights, owners, parts

__all__ = ["Shard", "ShardedOptimizers", "holder", "holds_nothing", "whole_size"]


def whole_size(variable) -> int:
    """How many values ``variable`` has (its Keras shape: a part not held here has them too)."""
    return math.prod(int(d) for d in variable.shape)


def holder(optimizer):
    """The optimizer that holds the state: a ``LossScaleOptimizer``'s inner one, else itself."""
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def holds_nothing(optimizers: Sequence) -> bool:
    """Whether parts of ``optimizers``' state would hold nothing: there are some, none was taken in by parts yet,
    and none keeps a value per weight (SGD without momentum; one whose configuration does not rebuild it counts
    as keeping some).  The optimizer state in parts by default is whole there: parts would add a collective of
    every new weight to each step and save no memory (TensorFlow's MLP at batch 64 with SGD on two CPU devices:
    1.10x faster whole; ``benchmarks/optimizer_sharding/``)."""
    return bool(optimizers) and all(getattr(holder(o), "_multigpu_sharded", None) is None
                                    and optimizer_slots(o, unknown=None) == 0 for o in optimizers)


def _check_optimizer(inner) -> None:
    """Refuses, on every rank and before any step, what parts cannot compute exactly."""
    if inner.gradient_accumulation_steps and inner.global_clipnorm:
        raise ValueError(
            "shard_optimizer=True cannot take an optimizer with both `gradient_accumulation_steps` and "
            "`global_clipnorm`: the norm is over accumulated gradients that only their owners hold. "
            f"Received: gradient_accumulation_steps={inner.gradient_accumulation_steps}, "
            f"global_clipnorm={inner.global_clipnorm}. Use shard_optimizer=False, or clipnorm.")


class Shard:
    """One optimizer's partition: the owner of each variable it was built with, and which state is held here.

    Args:
        optimizer: the optimizer that holds the state.
        variables: the variables it was built with, in its order.
        sizes: each variable's number of values.
        weights: each rank's share of the state.
        rank: this rank.
    """

    def __init__(self, optimizer, variables: Sequence, sizes: Sequence[int], weights: Sequence[float],
                 rank: int) -> None:
        self.optimizer = optimizer
        self.variables = list(variables)
        self.owner = owners(sizes, weights)
        self.rank = rank
        self.parts = parts(sizes, self.owner, len(weights))
        self.mine = {id(v) for v, o in zip(self.variables, self.owner) if o == rank}
        self.dropped = False

    def slots(self) -> list[tuple[object, object]]:
        """``(state variable, its model variable)`` for every state variable in parts (EMA averages excluded)."""
        out = []
        for values in _compat.optimizer_slot_lists(self.optimizer):
            out += [(s, v) for s, v in zip(values, self.variables) if s is not None]
        return out


class ShardedOptimizers:
    """The optimizers in parts of one parallel model (see the module docstring); a backend gives the storage and
    the collective.

    Args:
        comm: the run's collectives.
        ledger: the model's ledger (notes what is set on the optimizers).
        weights: each rank's share of the state (default: the devices' memory; equal where one is unknown).
    """

    #: whether the update runs inside a traced function, where a Python decision on the step count cannot be made
    traced = False

    def __init__(self, comm, ledger, weights: Sequence[float] | None = None) -> None:
        self.comm = comm
        self.ledger = ledger
        self.weights = list(weights) if weights is not None else memory_weights(
            self.device_memory(comm.runtime.devices))
        self._shards: dict[int, Shard] = {}  # by id of the optimizer that holds the state
        self.parted: set[int] = set()  # the variables whose weights are in parts (``shard="weights"``), by id

    # ------------------------------------------------------------ the backend's part
    def device_memory(self, devices) -> list[int | None]:
        """Each device's memory in bytes where known: a CPU device's given size (``cpu:0/8GiB``)."""
        return [None if d.memory is None else int(d.memory) for d in devices]

    def size(self, variable) -> int:
        """How many values ``variable`` holds in memory here."""
        raise NotImplementedError

    def empty(self, reference):
        """A value of no elements for a state variable of ``reference`` that this rank does not own."""
        raise NotImplementedError

    def resize(self, slot, variable, whole: bool) -> None:
        """Gives ``slot`` (the state of model variable ``variable``) room for its whole value (zeros), or lets go
        of it (no elements)."""
        raise NotImplementedError

    def sum_owned(self, pairs: list[tuple[object, object]], shard: Shard, tag: int, what: str) -> None:
        """Each ``(variable, model variable)`` pair's value, from the rank owning the model variable, on every
        rank (a collective)."""
        raise NotImplementedError

    # ------------------------------------------------------------ wiring
    def see(self, optimizer) -> None:
        """Takes ``optimizer`` in (once): its update runs on the owned variables, its state is in parts once it
        is built (at once if it is), and loading fills the whole state."""
        inner = holder(optimizer)
        if inner is None or getattr(inner, "_multigpu_sharded", None) is self:
            return
        _check_optimizer(inner)
        keras_apply = _compat.backend_apply_gradients(inner)
        shards = self

        def sharded_apply(opt, grads, variables):
            shards._apply(opt, keras_apply, list(grads), list(variables))

        self.ledger.set(inner, "_multigpu_sharded", self)
        self.ledger.set(inner, "_backend_apply_gradients", types.MethodType(sharded_apply, inner))
        self.ledger.set(inner, "_backend_reset_gradient_accumulators",
                        types.MethodType(_reset_held_accumulators(self), inner))
        for one in {id(o): o for o in (optimizer, inner)}.values():
            self._load_whole(one)
        if inner.built:
            self._shard(inner)

    def prepare(self, optimizer, variables: Sequence) -> None:
        """Builds ``optimizer`` for ``variables`` with only the owned state (before Keras would build it
        whole): the parts not owned never take memory."""
        self.see(optimizer)
        inner = holder(optimizer)
        if optimizer.built or not variables:
            return
        shard = Shard(inner, variables, [whole_size(v) for v in variables], self.weights, self.comm.rank)
        keras_add = type(inner).add_variable_from_reference.__get__(inner)
        empty = self.empty

        def add_variable_from_reference(opt, reference_variable, name=None, initializer="zeros"):
            if id(reference_variable) in shard.mine or name == "average":  # EMA averages stay whole
                return keras_add(reference_variable, name=name, initializer=initializer)
            return keras_add(reference_variable, name=name,
                             initializer=lambda shape, dtype=None: empty(reference_variable))

        # For this build only: not noted in the ledger, and gone again before anything else runs.
        object.__setattr__(inner, "add_variable_from_reference", types.MethodType(add_variable_from_reference, inner))
        try:
            optimizer.build(list(variables))
        finally:
            object.__delattr__(inner, "add_variable_from_reference")
        shard.dropped = True
        self._shards[id(inner)] = shard

    def shard_of(self, optimizer) -> Shard | None:
        """``optimizer``'s partition, once it is built in parts."""
        return self._shards.get(id(holder(optimizer)))

    def before_step(self) -> None:
        """Lets go again of the parts not owned that a load filled (outside any traced function)."""
        for shard in self._shards.values():
            if not shard.dropped:
                self._drop(shard)

    def _load_whole(self, optimizer) -> None:
        keras_load = type(optimizer).load_own_variables.__get__(optimizer)
        shards = self

        def load_own_variables(opt, store):
            shard = shards._shards.get(id(holder(opt)))
            if shard is not None and shard.dropped:
                shards._zeros(shard)  # the file has the whole state: every rank reads it, lets go of parts later
            return keras_load(store)

        self.ledger.set(optimizer, "load_own_variables", types.MethodType(load_own_variables, optimizer))

    def _shard(self, inner) -> Shard:
        shard = self._shards.get(id(inner))
        if shard is None:
            variables = _compat.optimizer_variables(inner)
            shard = self._shards[id(inner)] = Shard(inner, variables, [whole_size(v) for v in variables],
                                                    self.weights, self.comm.rank)
        if not shard.dropped and not self.traced:
            self._drop(shard)
        return shard

    def _drop(self, shard: Shard) -> None:
        for slot, variable in shard.slots():
            if id(variable) not in shard.mine:
                self.resize(slot, variable, whole=False)
        shard.dropped = True

    def _zeros(self, shard: Shard) -> None:
        for slot, variable in shard.slots():
            if id(variable) not in shard.mine and self.size(slot) != whole_size(variable):
                self.resize(slot, variable, whole=True)
        shard.dropped = False

    # ------------------------------------------------------------ the update
    def _apply(self, opt, keras_apply, grads: list, variables: list) -> None:
        shard = self._shard(opt)
        if opt.global_clipnorm and opt.global_clipnorm > 0 and not opt.clipnorm:
            grads = _compat.clip_by_global_norm(grads, opt.global_clipnorm)  # over every gradient, as Keras would
        update = True
        if opt.gradient_accumulation_steps and not self.traced:
            steps = opt.gradient_accumulation_steps  # Keras updates when (iterations + 1) % steps == 0
            update = (_compat.applied_steps(opt) + 1) % steps == 0
        owned = [i for i, v in enumerate(variables) if id(v) in shard.mine]
        with _keras_features_off(opt):
            if owned:
                keras_apply([grads[i] for i in owned], [variables[i] for i in owned])
        if update:  # traced: every step (the weights a step without an update shares are unchanged)
            self.updated(shard, variables)
        if opt.use_ema:
            _compat.update_ema(opt)

    def updated(self, shard: Shard, variables: list) -> None:
        """The new weights of the owned ``variables`` on every rank (a collective; weights in parts stay with
        their owners)."""
        self.sum_owned([(v, v) for v in variables if id(v) not in self.parted], shard, 7, "the updated weights")

    # ------------------------------------------------------------ whole state
    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every optimizer's whole state on every rank (a collective), then in parts again."""
        self.gather()
        try:
            yield
        finally:
            for shard in self._shards.values():
                self._drop(shard)

    def repartition(self, weights: Sequence[float]) -> None:
        """Each rank's share of the state from now on (``weights``; a rank at 0 holds none: a device set aside,
        :mod:`multigpu.balancing.parking`): the whole state on every rank first (a collective), then each
        rank's new part kept."""
        self.gather()
        self.weights = list(weights)
        for key, shard in list(self._shards.items()):
            new = Shard(shard.optimizer, shard.variables, [whole_size(v) for v in shard.variables], self.weights,
                        self.comm.rank)
            self._shards[key] = new
            self._drop(new)

    def gather(self) -> None:
        """Every optimizer's whole state on every rank (a collective); it stays whole until the next update
        puts it in parts again."""
        for shard in self._shards.values():
            if shard.dropped:
                self._zeros(shard)
                self.sum_owned(shard.slots(), shard, 8, "the optimizer's state")


def _reset_held_accumulators(shards: ShardedOptimizers):
    """Keras's reset of the gradient accumulators after an accumulated update, for those this rank holds."""
    def reset(opt) -> None:
        _compat.reset_held_accumulators(opt, lambda a: shards.size(a) == math.prod(a.shape))
    return reset


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
