"""Vectors of a TensorFlow step: gradients and metric states flattened into float32 and back, and batch helpers."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from multigpu._keras.model_parts import results_with_states

__all__ = ["flat", "metric_results", "one_row_of_zeros", "split", "tensors"]


def flat(values) -> list:
    """Each value as a float32 vector."""
    return [tf.reshape(tf.cast(v, tf.float32), [-1]) for v in values]


def split(vector, like: list, offset: int = 0) -> list:
    """Pieces of ``vector`` shaped and typed as ``like`` (variables), from ``offset`` on."""
    out = []
    for ref in like:
        n = int(np.prod(ref.shape))
        part = tf.reshape(vector[offset : offset + n], ref.shape)
        dtype = tf.as_dtype(keras.backend.standardize_dtype(ref.dtype))
        if not dtype.is_floating:
            part = tf.round(part)
        out.append(tf.cast(part, dtype))
        offset += n
    return out


def metric_results(model, summed, metric_refs: list, offset: int) -> dict:
    """Keras's metric results with every state replaced by its sum over ranks (in a function or eagerly)."""
    return results_with_states(model, metric_refs, split(summed, metric_refs, offset))


def one_row_of_zeros(data):
    """A stand-in batch of one row of zeros, shaped and typed as ``data`` (a batch with no rows)."""
    return keras.tree.map_structure(
        lambda a: None if a is None else tf.zeros((1, *a.shape[1:]), tf.as_dtype(a.dtype)), data)


def tensors(data):
    """A batch (NumPy arrays or tensors, a batch cut again after a loss) as tensors, as the step's functions
    take it."""
    return keras.tree.map_structure(lambda a: None if a is None else tf.convert_to_tensor(a), data)
