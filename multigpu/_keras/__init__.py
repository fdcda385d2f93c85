"""The Keras internals multigpu reads and the parts of a model both backends' steps use: the layer below the
backends and the data sources (``compat``: every Keras internal, checked against the Keras in use;
``model_parts``: a model's own steps, optimizers and BatchNorm layers).  Imports nothing of multigpu above it."""
