"""Vectors of a JAX step: gradients, metric states and tails flattened into one float32 vector and back."""

from __future__ import annotations

import jax.numpy as jnp
import keras
import numpy as np

from multigpu._keras.model_parts import results_with_states
from multigpu.backend.facts import HALF_PRECISION

__all__ = ["COMPRESSION", "flat", "metric_results", "one_row_of_zeros", "split"]


def flat(values) -> list:
    return [jnp.ravel(v).astype(jnp.float32) for v in values]


def split(vector, like: list, offset: int = 0) -> list:
    """Pieces of ``vector`` shaped and typed as ``like``, from ``offset`` on."""
    out = []
    for ref in like:
        n = int(np.prod(ref.shape))
        part = vector[offset : offset + n].reshape(ref.shape)
        if not jnp.issubdtype(ref.dtype, jnp.floating):
            part = jnp.round(part)
        out.append(part.astype(ref.dtype))
        offset += n
    return out


COMPRESSION = {None: None, **{k: getattr(jnp, v) for k, v in HALF_PRECISION.items()}}


def one_row_of_zeros(data):
    """A stand-in batch of one row of zeros, shaped and typed as ``data`` (a batch with no rows)."""
    return keras.tree.map_structure(
        lambda a: None if a is None else jnp.zeros((1, *np.shape(a)[1:]), getattr(a, "dtype", np.float32)), data)


def metric_results(model, summed, metric_refs: list, offset: int) -> dict:
    """Keras's metric results with every state replaced by its sum over ranks (traced or eager)."""
    return results_with_states(model, metric_refs, split(summed, metric_refs, offset))
