"""The optimizer's state in parts on JAX (the rest is :mod:`multigpu.backend.sharding`).

On JAX the optimizer's state is a list of values that Keras's ``fit`` passes
through the compiled step and writes back into the variables at each
epoch's end.  A state variable this rank does not own holds a value of no
elements there and in the variable alike (a JAX variable's shape follows its
value).  The compiled update applies Keras's own update to the owned
variables; the new weights then reach every rank in one collective after it
(:meth:`ShardedOptimizers.share`: XLA's all-reduce of one vector per dtype
holding this rank's owned values and zeros elsewhere), as for a step of the
model's own, whose ``stateless_apply`` runs eagerly.  An optimizer with an
EMA is refused: its averages need every new weight inside the compiled
update.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from multigpu._keras import compat as _compat
from multigpu.backend.sharding import Shard, holder
from multigpu.backend.sharding import ShardedOptimizers as _Neutral

__all__ = ["ShardedOptimizers"]


class ShardedOptimizers(_Neutral):
    """The optimizers in parts of one parallel model on JAX (arguments: the neutral class's)."""

    traced = True

    def see(self, optimizer) -> None:
        inner = holder(optimizer)
        if inner is not None and inner.use_ema:
            raise ValueError("shard_optimizer=True on JAX cannot take an optimizer with `use_ema=True`: the "
                             "moving averages need every new weight inside the compiled update. Received: "
                             f"{type(inner).__name__}(use_ema=True). Use shard_optimizer=False, or the torch or "
                             "TensorFlow backend.")
        super().see(optimizer)

    def size(self, variable) -> int:
        return int(np.prod(variable.shape))

    def empty(self, reference):
        return jnp.zeros((0,), dtype=reference.dtype)

    def resize(self, slot, variable, whole: bool) -> None:
        shape = tuple(variable.shape) if whole else (0,)
        _compat.set_jax_variable_value(slot, jnp.zeros(shape, dtype=slot.dtype))

    def updated(self, shard: Shard, variables: list) -> None:
        """Nothing inside the compiled update: :meth:`share` runs after it."""

    # ------------------------------------------------------------ after the compiled update
    def share(self, optimizer, variables, values: list) -> list:
        """``values`` (the new values of ``variables``, which ``optimizer`` updates) with every rank's owned
        values in place of the others' (an all-gather of each rank's owned values, per dtype)."""
        shard = self._shards.get(id(holder(optimizer)))
        if shard is None:
            return list(values)
        owner = {id(v): o for v, o in zip(shard.variables, shard.owner)}
        ranks = [owner.get(id(v), self.comm.rank) for v in variables]
        out = list(values)
        by_dtype: dict = {}
        for i, value in enumerate(values):
            by_dtype.setdefault(jnp.dtype(value.dtype), []).append(i)
        for dtype, indices in by_dtype.items():
            sizes = {i: int(np.prod(values[i].shape)) for i in indices}
            parts = [sum(sizes[i] for i in indices if ranks[i] == r) for r in range(self.comm.world_size)]
            mine = jnp.concatenate([jnp.zeros(0, dtype)] + [jnp.reshape(values[i], (-1,)) for i in indices
                                                             if ranks[i] == self.comm.rank])
            rows = self.comm.gather_rows(mine, max(parts), "sharing the updated weights")
            taken = [0] * self.comm.world_size
            for i in indices:  # each rank's row holds its owned values in the variables' order
                r, n = ranks[i], sizes[i]
                if r != self.comm.rank:
                    out[i] = jnp.asarray(rows[r, taken[r] : taken[r] + n]).reshape(values[i].shape)
                taken[r] += n
        return out

    def before_step(self, optimizer=None, values=None):
        """Lets go of the parts not owned that a load filled; with ``optimizer`` and its state ``values`` (the
        step's), returns the values with those parts of no elements (as given when nothing was filled: the
        common case, checked at every step)."""
        if all(shard.dropped for shard in self._shards.values()):
            return values
        values = None if values is None else list(values)
        positions = {} if optimizer is None else {id(v): i for i, v in enumerate(optimizer.variables)}
        for shard in self._shards.values():
            if shard.dropped:
                continue
            for slot, variable in shard.slots():
                if id(variable) not in shard.mine:
                    self.resize(slot, variable, whole=False)
                    if values is not None and id(slot) in positions:
                        values[positions[id(slot)]] = jnp.zeros((0,), dtype=slot.dtype)
            shard.dropped = True
        return values

    def sum_owned(self, pairs: list[tuple[object, object]], shard: Shard, tag: int, what: str) -> None:
        by_dtype: dict = {}
        for variable, model_variable in pairs:
            by_dtype.setdefault(variable.dtype, []).append((variable, model_variable, id(model_variable) in shard.mine))
        for dtype, group in by_dtype.items():
            sizes = [int(np.prod(m.shape)) for _, m, _ in group]
            vector = np.concatenate([np.zeros(0, dtype)] + [
                np.asarray(v.value, dtype).reshape(-1) if mine else np.zeros(n, dtype)
                for (v, _, mine), n in zip(group, sizes)])
            summed = self.comm.reduce(vector, f"sharing {what}")
            offset = 0
            for (variable, model_variable, mine), n in zip(group, sizes):
                if not mine:
                    variable.assign(jnp.asarray(summed[offset : offset + n]).reshape(model_variable.shape))
                offset += n
