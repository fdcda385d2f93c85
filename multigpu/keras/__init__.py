"""The Keras integration, in small parts: ``parallel`` (the parts of one model, and ``state``), ``loops``
(fit/evaluate/predict/on_batch), ``data`` (each rank's share of every batch), ``callbacks``, ``saving``, and
``_compat`` (every Keras internal used, version-checked).  The steps are the backend's."""
