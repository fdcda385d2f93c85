"""Each rank's rows of every global batch, for every input form, read once per machine and ahead of the step.

* arrays and tensors (:mod:`~multigpu.data.arrays`): nothing is read; each
  rank slices its rows out of memory;
* a ``torch.utils.data.DataLoader`` over a map-style dataset
  (:mod:`~multigpu.data.loader`): each rank loads only the indices of its
  share, with the user's workers (per rank, as with DDP), so a machine reads
  only its ranks' rows;
* a ``keras.utils.PyDataset`` (:mod:`~multigpu.data.readers`): each global
  batch is read once per machine, the machine's ranks taking turns, each with
  the dataset's workers;
* generators, iterable datasets and other DataLoaders
  (:mod:`~multigpu.data.readers`): each global batch is read once per
  machine, by its local rank 0, in a background thread.

Batches read once for a machine reach its ranks through files in shared memory
(:mod:`~multigpu.data.exchange`); every rank cuts its rows by the shares in
force when it takes the batch.  :func:`multigpu.data.sources.source_for` picks the
path.  The package's root imports nothing, so that the supervisor can clean
up shared memory without importing Keras.
"""
