"""Keras's own optimizer updates, computed block by block on CPU tensors.

Keras's torch optimizers update all weights one operation at a time
(``torch._foreach_mul_`` over every tensor, then ``_foreach_add_`` over every
tensor, ...): each operation streams every weight, gradient and slot through
memory.  On a large model that is memory-bound (RMSprop on 41 million weights:
about 0.5 s a step on one core, and twice that when two devices of one machine
update at once).  :func:`install` makes an optimizer run the *same operations
in the same order* on one block of each tensor at a time, so a block's
operations run in cache: the results are Keras's, bit for bit (every
operation is elementwise), and the update streams memory about once.

Installed for SGD with momentum, RMSprop and Adam/AdamW on float32 CPU
tensors, when the optimizer's class keeps Keras's own update; anything else
(other optimizers, a subclass with its own update, GPU tensors, other dtypes)
keeps Keras's update untouched.
"""

from __future__ import annotations

import types

import torch

from multigpu._keras import compat as _compat

__all__ = ["BLOCK", "install"]

BLOCK = 1 << 17  # values per block: RMSprop's update of 41M weights on one core took 100-118 ms per step at
# 128K, 98-105 ms at 256K, 110 ms at 64K, 165 ms at 16K (Keras's own: 510 ms); a block's tensors stay in cache


def install(optimizer, ledger) -> bool:
    """Makes ``optimizer`` compute its own update block by block, if it is one this module knows.

    Args:
        optimizer: a Keras optimizer (torch backend).
        ledger: the model's :class:`~multigpu._keras.ledger.Ledger`, which notes the change.

    Returns:
        Whether the block-wise update is in place.
    """
    if optimizer is None:
        return False
    if getattr(optimizer, "_multigpu_blockwise", None) is not None:
        return bool(optimizer._multigpu_blockwise)
    owner = _compat.update_step_owner(optimizer)
    classes = _compat.torch_optimizer_classes()
    known = {classes[name]: fn for name, fn in (("SGD", _sgd), ("RMSprop", _rmsprop), ("Adam", _adam))
             if name in classes}
    update = known.get(owner) if owner is not None else None
    if update is _sgd and optimizer.momentum == 0:
        update = None  # without momentum Keras's update is one operation already
    ledger.set(optimizer, "_multigpu_blockwise", update is not None)
    if update is None:
        return False
    keras_update = type(optimizer)._parallel_update_step.__get__(optimizer)

    def blockwise_update_step(self, grads, variables, learning_rate):
        tensors = [v.value for v in variables]
        if not _blockable(grads, tensors):
            return keras_update(grads, variables, learning_rate)
        with torch.no_grad():
            update(self, grads, variables, tensors, learning_rate)
        return None

    ledger.set(optimizer, "_parallel_update_step", types.MethodType(blockwise_update_step, optimizer))
    return True


def _blockable(grads, tensors) -> bool:
    for g, t in zip(grads, tensors):
        if g is None or t.device.type != "cpu" or t.dtype != torch.float32 or g.dtype != torch.float32:
            return False
        if not (t.is_contiguous() and g.is_contiguous()) or g.shape != t.shape:
            return False
    return True


def _blocks(*tensors):
    """Matching blocks of flat views of ``tensors`` (all of one size)."""
    flat = [t.view(-1) for t in tensors]
    n = flat[0].numel()
    for start in range(0, n, BLOCK):
        yield [f[start : start + BLOCK] for f in flat]


def _slots(optimizer, name: str, variables) -> list:
    return [_compat.optimizer_slot(optimizer, name, v).value for v in variables]


# Each function below repeats, on one block at a time, the operations of the
# named Keras class's ``_parallel_update_step`` (keras/src/backend/torch/optimizers/).


def _sgd(opt, grads, variables, tensors, learning_rate) -> None:
    momenta = _slots(opt, "momentums", variables)
    step = -learning_rate
    for g, w, b in zip(grads, tensors, momenta):
        for gb, wb, bb in _blocks(g, w, b):
            bb.mul_(opt.momentum)
            bb.add_(gb, alpha=step)
            if opt.nesterov:
                wb.add_(gb, alpha=step)
                wb.add_(bb, alpha=opt.momentum)
            else:
                wb.add_(bb)


def _rmsprop(opt, grads, variables, tensors, learning_rate) -> None:
    from keras import ops

    lr = ops.cast(learning_rate, tensors[0].dtype)
    rho = opt.rho
    velocities = _slots(opt, "_velocities", variables)
    averages = _slots(opt, "_average_gradients", variables) if opt.centered else [None] * len(tensors)
    momenta = _slots(opt, "_momentums", variables) if opt.momentum > 0 else [None] * len(tensors)
    for g, w, v, a, m in zip(grads, tensors, velocities, averages, momenta):
        extra = [t for t in (a, m) if t is not None]
        for gb, wb, vb, *rest in _blocks(g, w, v, *extra):
            ab = rest.pop(0) if a is not None else None
            mb = rest.pop(0) if m is not None else None
            vb.mul_(rho)
            vb.add_(gb * gb, alpha=1 - rho)
            denominator = vb + opt.epsilon
            if ab is not None:
                ab.mul_(rho)
                ab.add_(gb, alpha=1 - rho)
                denominator.add_(ab * ab, alpha=-1)
            denominator.sqrt_()
            increment = (gb * lr) / denominator
            if mb is not None:
                mb.mul_(opt.momentum)
                mb.add_(increment)
                wb.add_(mb, alpha=-1)
            else:
                wb.add_(increment, alpha=-1)


def _adam(opt, grads, variables, tensors, learning_rate) -> None:
    from keras import ops

    dtype = tensors[0].dtype
    lr = ops.cast(learning_rate, dtype)
    local_step = ops.cast(opt.iterations + 1, dtype)
    beta_1_power = ops.power(ops.cast(opt.beta_1, dtype), local_step)
    beta_2_power = ops.power(ops.cast(opt.beta_2, dtype), local_step)
    alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    firsts = _slots(opt, "_momentums", variables)
    seconds = _slots(opt, "_velocities", variables)
    maxima = _slots(opt, "_velocity_hats", variables) if opt.amsgrad else [None] * len(tensors)
    for g, w, m, v, h in zip(grads, tensors, firsts, seconds, maxima):
        extra = [h] if h is not None else []
        for gb, wb, mb, vb, *rest in _blocks(g, w, m, v, *extra):
            mb.mul_(opt.beta_1)
            mb.add_(gb, alpha=1 - opt.beta_1)
            vb.mul_(opt.beta_2)
            vb.add_(gb * gb, alpha=1 - opt.beta_2)
            second = vb
            if rest:  # amsgrad: the running maximum stands for the second moment
                rest[0].copy_(torch.maximum(rest[0], vb))
                second = rest[0]
            wb.add_((mb * alpha) / (torch.sqrt(second) + opt.epsilon), alpha=-1)

