"""The torch internals the replay (:mod:`multigpu.backend.torch.replay`) and the weights in parts
(:mod:`multigpu.backend.torch.weights`) use, in one place, checked.

``make_fx`` records the forward pass; an operation's ``OpOverload`` carries
its schema (which arguments it writes, whether it draws random numbers); the
pytree utilities flatten a batch as torch does.  None of these is public API,
so :func:`missing` names any that the torch in use lacks, and the replay then
keeps Keras's own pass, saying why (the numbers are the same either way).
"""

from __future__ import annotations

import torch

__all__ = ["OpOverload", "argument", "make_fx", "missing", "random_tag", "storage_uses", "tree_flatten",
           "written_arguments"]


def missing() -> list[str]:
    """The internals this torch does not have where the replay looks for them."""
    gaps = []
    try:
        from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401
    except ImportError:
        gaps.append("torch.fx.experimental.proxy_tensor.make_fx")
    if not hasattr(getattr(torch, "_ops", None), "OpOverload"):
        gaps.append("torch._ops.OpOverload")
    if not hasattr(getattr(torch, "Tag", None), "nondeterministic_seeded"):
        gaps.append("torch.Tag.nondeterministic_seeded")
    if not hasattr(getattr(getattr(torch, "utils", None), "_pytree", None), "tree_flatten"):
        gaps.append("torch.utils._pytree.tree_flatten")
    return gaps


def make_fx(fn):
    """``torch.fx.experimental.proxy_tensor.make_fx(fn)``."""
    from torch.fx.experimental.proxy_tensor import make_fx as record

    return record(fn)


OpOverload = torch._ops.OpOverload


def random_tag():
    """The tag of operations that draw random numbers."""
    return torch.Tag.nondeterministic_seeded


def written_arguments(node, schema) -> list:
    """What ``node`` passes for the arguments its operation writes in place."""
    return [node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def tree_flatten(tree) -> tuple[list, object]:
    """``torch.utils._pytree.tree_flatten``: leaves and spec."""
    return torch.utils._pytree.tree_flatten(tree)


def argument(node, schema, name: str):
    """The value ``node`` passes for its operation's argument ``name`` (None when absent)."""
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


def storage_uses(tensor: torch.Tensor) -> int | None:
    """How many holders ``tensor``'s storage has besides the one this call makes (``torch._C._storage_Use_Count``:
    1 where ``tensor`` alone holds it, more where a view of it lives on, say in an autograd graph); None where this
    torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(tensor.untyped_storage()._cdata)) - 1
