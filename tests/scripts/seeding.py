"""Seeds a test script as ``keras.utils.set_random_seed`` does on a machine without TensorFlow.

Keras's function imports TensorFlow wherever it is installed, to seed ``tf.data`` pipelines, whatever the
backend: about 2 s of every torch or JAX process's start (a test's ranks and its one-device reference alike),
and TensorFlow's import draws from Python's and NumPy's global generators on its way.  The scripts that feed
no ``tf.data`` pipeline seed without it, every rank and every reference the same way, with the function the
benchmark workers seed with; ``tfdata.py``, ``notebook.py``'s cases that compare weights, the examples and
``tests/test_rank_entry.py`` keep Keras's own (TensorFlow imported by it on a torch rank, and kept quiet there,
stays tested).  Where TensorFlow is already imported (its backend), this is Keras's function as it is.
"""

from multigpu.bench.worker import set_random_seed

__all__ = ["set_random_seed"]
