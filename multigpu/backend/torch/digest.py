"""Gradients compared bit for bit without holding them: each one a digest of its bytes as it is made.

The replay's check (:mod:`multigpu.backend.torch.replay`) compares the gradients of Keras's pass with the
replayed pass's.  Holding both sets took two copies of the gradients at the step that records, more than any
other step holds; here a hook on each variable reads its gradient as the backward pass makes it, keeps a digest
of its bytes and hands autograd back zeros of no memory (an expanded scalar), so the check holds one
variable's gradient at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

__all__ = ["gradient_digests"]


def gradient_digests(loss: torch.Tensor, params: Sequence[torch.Tensor], retain_graph: bool = False) -> list:
    """Each of ``params``' gradient of ``loss`` as ``(dtype, shape, digest of its bytes)``, None where unused."""
    found: list = [None] * len(params)

    def reader(i: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            data = grad.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
            found[i] = (grad.dtype, tuple(grad.shape), hashlib.blake2b(data, digest_size=32).digest())
            return grad.new_zeros(()).expand_as(grad)

        return hook

    handles = [p.register_hook(reader(i)) for i, p in enumerate(params)]
    try:
        torch.autograd.grad(loss, list(params), retain_graph=retain_graph, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return found
