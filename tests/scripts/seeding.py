"""Seeds a test script as ``keras.utils.set_random_seed`` does on a machine without TensorFlow.

Keras's function imports TensorFlow wherever it is installed, to seed ``tf.data`` pipelines, whatever the
backend: about 2 s of every torch or JAX process's start (a test's ranks and its one-device reference alike),
and TensorFlow's import draws from Python's and NumPy's global generators on its way.  The scripts that feed
no ``tf.data`` pipeline seed without it, every rank and every reference the same way; ``tfdata.py``,
``notebook.py``, the examples and ``tests/test_rank_entry.py`` keep Keras's own (TensorFlow imported by it on a
torch rank, and kept quiet there, stays tested).  Where TensorFlow is already imported (its backend), this is
Keras's function as it is.
"""

import sys

import keras


class _NotInstalled:
    available = False


def set_random_seed(seed: int) -> None:
    """``keras.utils.set_random_seed(seed)`` without TensorFlow's seed unless TensorFlow is imported."""
    try:
        from keras.src.utils import rng_utils
    except ImportError:  # a Keras that moved it: its own function, TensorFlow and all
        rng_utils = None
    if rng_utils is None or not hasattr(rng_utils, "tf") or "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    kept = rng_utils.tf
    rng_utils.tf = _NotInstalled()
    try:
        keras.utils.set_random_seed(seed)
    finally:
        rng_utils.tf = kept
