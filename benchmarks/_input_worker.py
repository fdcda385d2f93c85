"""One run of ``bench_input.py``: a small convnet trained from one input pipeline; writes samples/s as JSON.

Started by ``bench_input.py`` (never by hand in normal use), in three ways:

* plain Keras ``fit`` on one core: ``python _input_worker.py --case C --out R.json``;
* multigpu: ``multigpu run --devices cpu:0,cpu:1 _input_worker.py --case C --out R.json --multigpu``;
* a hand-written PyTorch DDP loop: ``--ddp`` with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set, one
  process per core, each loading only its rows through ``DistributedSampler`` (or, for the cases
  that read whole batches, its own half-size batches; for ``tf.data``, its own ``Dataset.shard``)
  with the same costs and workers.

Cases (every one at global batch 128 of 32x32x3 images; costs are per batch of 128 rows,
proportional to the rows read):

* ``pyds-io``: a ``keras.utils.PyDataset`` whose ``__getitem__`` waits 80 ms (a file read), ``workers=4``;
* ``pyds-cpu``: a ``PyDataset`` whose ``__getitem__`` augments its images with NumPy (random crops,
  flips, brightness, normalisation, 12 times over: about as long as the training step), ``workers=2``;
* ``loader-io``: a ``torch.utils.data.DataLoader`` over a map-style dataset whose items wait 0.6 ms,
  ``num_workers=2``;
* ``loader-cpu``: the same DataLoader with the NumPy augmentation per item;
* ``gen-io``: a generator that waits ``--gen-wait`` ms per batch (default 80);
* ``tfdata-io``: a ``tf.data`` pipeline whose ``map(num_parallel_calls=4)`` waits 80 ms per batch
  (a file read, in ``tf.numpy_function``), then ``prefetch``;
* ``tfdata-cpu``: the same with the NumPy augmentation in the ``map`` (``num_parallel_calls=2``);
* ``tfdir-io``: ``keras.utils.image_dataset_from_directory`` over 3,072 PNG files of 32x32 pixels
  (written once under the temporary folder), decoded by TensorFlow;
* ``arrays-none``: the same images as in-memory arrays: what the model reaches when nothing is read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

BATCH = 128
IO_PER_BATCH = 0.080
TF_ROUNDS = 30  # rounds of TensorFlow's image augmentation per batch in ``tfdata-cpu``
ITEM_WAIT = 0.0006
POOL = 2048  # distinct images, read round-robin


def images():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.random((POOL, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, POOL).astype("int64")
    return x, y


def augment(x, rng, rounds: int = 12):
    """Random 28x28 crops padded back to 32x32, flips, brightness and per-image normalisation, ``rounds`` times
    (12: about as long as the training step of the width-2 convnet on one core)."""
    for _ in range(rounds):
        x = _augment_once(x, rng)
    return x


def _augment_once(x, rng):
    import numpy as np

    n = len(x)
    out = np.empty_like(x)
    for k in range(n):
        i, j = rng.integers(0, 5, 2)
        crop = x[k, i : i + 28, j : j + 28]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        out[k] = np.pad(crop, ((2, 2), (2, 2), (0, 0)), mode="reflect")
    out *= rng.uniform(0.8, 1.2, (n, 1, 1, 1)).astype(np.float32)
    mean = out.mean(axis=(1, 2, 3), keepdims=True)
    std = out.std(axis=(1, 2, 3), keepdims=True) + 1e-6
    return ((out - mean) / std).astype(np.float32)


def read(rows, cost: str, x, y):
    """The rows' images and labels at the case's cost."""
    import numpy as np

    index = np.asarray(rows) % POOL
    xb, yb = x[index], y[index]
    if cost == "io":
        time.sleep(IO_PER_BATCH * len(index) / BATCH)
    elif cost == "cpu":
        xb = augment(xb, np.random.default_rng(int(index[0])))
    return xb, yb


def pydataset(cost: str, batches: int, rows: int = BATCH):
    import keras

    x, y = images()

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return batches

        def __getitem__(self, i):
            return read(range(i * rows, (i + 1) * rows), cost, x, y)

    return Batches(workers=4 if cost == "io" else 2)


def row_dataset(cost: str, per_item: bool = True):
    import numpy as np
    import torch

    x, y = images()

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            if cost == "io":
                time.sleep(ITEM_WAIT)
                return torch.from_numpy(x[i % POOL]), int(y[i % POOL])
            xb, yb = read([i], cost, x, y)
            return torch.from_numpy(np.ascontiguousarray(xb[0])), int(yb[0])

    return Rows()


def dataloader(cost: str, batches: int):
    import torch

    ds = torch.utils.data.Subset(row_dataset(cost), range(batches * BATCH))
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=2, persistent_workers=True)


def generator(batches: int, wait: float):
    x, y = images()
    for i in range(batches):
        time.sleep(wait)
        yield read(range(i * BATCH, (i + 1) * BATCH), "none", x, y)


def tf_pipeline(cost: str, batches: int, rows: int = BATCH, shard: tuple[int, int] | None = None):
    """A ``tf.data`` pipeline of ``batches`` batches of ``rows`` rows at the case's cost: a ``py_function``
    per batch in ``map(num_parallel_calls=4)`` (io: waits as a file read does; cpu: the NumPy augmentation,
    ``num_parallel_calls=2``), then ``prefetch``.  ``shard=(world, rank)``: ``Dataset.shard``, as a DDP rank
    reads its own part."""
    import tensorflow as tf

    x, y = images()

    def load(i):
        xb, yb = read(range(int(i) * rows, (int(i) + 1) * rows), cost, x, y)
        return xb, yb

    def mapped(i):
        xb, yb = tf.numpy_function(load, [i], (tf.float32, tf.int64))
        xb.set_shape((rows, 32, 32, 3))
        yb.set_shape((rows,))
        return xb, yb

    images_t, labels_t = tf.constant(x), tf.constant(y)

    def augmented(i):  # TensorFlow's own image ops, as a tf.data pipeline augments: no Python, no GIL
        index = (tf.range(rows, dtype=tf.int64) + i * rows) % POOL
        xb, yb = tf.gather(images_t, index), tf.gather(labels_t, index)
        for _ in range(TF_ROUNDS):
            xb = tf.image.resize_with_crop_or_pad(tf.image.random_crop(xb, (rows, 28, 28, 3), seed=1), 32, 32)
            xb = tf.image.random_flip_left_right(xb, seed=2)
            xb = tf.image.random_brightness(xb, 0.2, seed=3)
            xb = tf.image.per_image_standardization(xb)
        return xb, yb

    ds = tf.data.Dataset.range(batches * (shard[0] if shard else 1))
    if shard:
        ds = ds.shard(*shard)
    ds = ds.map(mapped if cost == "io" else augmented, num_parallel_calls=4 if cost == "io" else 2)
    return ds.prefetch(tf.data.AUTOTUNE)


IMAGE_FILES = 3072


def image_folder() -> str:
    """A folder of ``IMAGE_FILES`` 32x32 PNG files in 10 classes, written once (and kept) under the temporary
    folder, for ``image_dataset_from_directory``."""
    import tempfile

    import keras

    folder = os.path.join(tempfile.gettempdir(), f"multigpu-bench-images-{IMAGE_FILES}")
    if os.path.isdir(folder):
        return folder
    x, y = images()
    staging = tempfile.mkdtemp(prefix="multigpu-bench-images-")
    for i in range(IMAGE_FILES):
        label = os.path.join(staging, f"class{int(y[i % POOL])}")
        os.makedirs(label, exist_ok=True)
        keras.utils.save_img(os.path.join(label, f"{i:05d}.png"), (x[i % POOL] * 255).astype("uint8"), scale=False)
    try:
        os.rename(staging, folder)
    except OSError:  # another process wrote it first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return folder


def directory_dataset(batch: int, shard: tuple[int, int] | None = None):
    """``keras.utils.image_dataset_from_directory`` over :func:`image_folder`, repeated for enough batches."""
    import keras
    import tensorflow as tf

    ds = keras.utils.image_dataset_from_directory(image_folder(), image_size=(32, 32), batch_size=None,
                                                  shuffle=True, seed=3, verbose=False)
    ds = ds.repeat()
    if shard:
        ds = ds.shard(*shard)
    return ds.batch(batch).map(lambda a, b: (a / 255.0, b)).prefetch(tf.data.AUTOTUNE)


def build(width: float = 2.0):
    import keras

    L = keras.layers
    inputs = keras.Input((32, 32, 3))
    h = L.Conv2D(round(16 * width), 3, activation="relu")(inputs)
    h = L.MaxPooling2D()(h)
    h = L.Conv2D(round(32 * width), 3, activation="relu")(h)
    h = L.MaxPooling2D()(h)
    h = L.Flatten()(h)
    h = L.Dense(64, activation="relu")(h)
    return keras.Model(inputs, L.Dense(10, activation="softmax")(h))


def keras_run(a) -> None:
    import keras
    import numpy as np

    keras.utils.set_random_seed(1)
    model = build(a.width)
    rank = 0
    if a.multigpu:
        import multigpu

        model = multigpu.parallelize(model, timeout=120)
        rank = multigpu.rank()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    batches = a.warmup + a.steps
    kind, cost = a.case.split("-")[:2]
    if kind == "pyds":
        data = pydataset(cost, batches)
    elif kind == "arrays":  # the same images in memory: what the model reaches when nothing is read
        x, y = images()
        index = np.arange(batches * BATCH) % POOL
        data = None
    elif kind == "loader":
        data = dataloader(cost, batches)
    elif kind == "tfdata":
        data = tf_pipeline(cost, batches)
    elif kind == "tfdir":
        data = directory_dataset(BATCH).take(batches)
    else:
        data = generator(batches, a.gen_wait / 1000)
    marks = {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            marks[step] = time.perf_counter()

    if data is None:
        model.fit(x[index], y[index], batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[Clock()])
    else:
        model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[Clock()])
    seconds = marks[batches - 1] - marks[a.warmup - 1]
    result = {"samples_per_second": a.steps * BATCH / seconds, "seconds": seconds}
    if a.multigpu:
        import multigpu

        report = multigpu.state(model).last_report
        result["input_share"] = [r["input"] / max(r["data"] + r["compute"] + r["wait"], 1e-9)
                                 for r in report["devices"]] if report else None
        result["report"] = report
        result["shares"] = multigpu.state(model).shares(BATCH)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)


def ddp_run(a) -> None:
    """A DDP loop: each rank loads only its own rows with the case's costs and workers, equal shares."""
    import keras
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.sched_setaffinity(0, {rank})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    keras.utils.set_random_seed(1)
    model = build(a.width)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = a.warmup + a.steps
    kind, cost = a.case.split("-")[:2]
    local = BATCH // world
    if kind == "pyds":  # whole-batch reads: each rank reads its own half-size batches, with the same workers
        x, y = images()

        class LocalBatches(torch.utils.data.Dataset):
            def __len__(self):
                return batches * world

            def __getitem__(self, i):
                xb, yb = read(range(i * local, (i + 1) * local), cost, x, y)
                return torch.from_numpy(xb), torch.from_numpy(yb)

        ds = LocalBatches()
        sampler = torch.utils.data.distributed.DistributedSampler(ds, world, rank, shuffle=False)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler,
                                             num_workers=4 if cost == "io" else 2, persistent_workers=True)
    elif kind in ("tfdata", "tfdir"):  # each rank reads its own shard (Dataset.shard) at half the batch
        pipeline = (tf_pipeline(cost, batches, local, (world, rank)) if kind == "tfdata"
                    else directory_dataset(local, (world, rank)).take(batches))
        loader = ((torch.from_numpy(xb.numpy()), torch.from_numpy(yb.numpy()).long()) for xb, yb in pipeline)
    else:
        ds = torch.utils.data.Subset(row_dataset(cost), range(batches * BATCH))
        sampler = torch.utils.data.distributed.DistributedSampler(ds, world, rank, shuffle=False)
        loader = torch.utils.data.DataLoader(ds, batch_size=local, sampler=sampler, num_workers=2,
                                             persistent_workers=True)
    marks = []
    for xb, yb in loader:
        probs = ddp(xb)
        loss = loss_fn(torch.log(probs + 1e-7), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        marks.append(time.perf_counter())
    seconds = marks[-1] - marks[a.warmup - 1]
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"samples_per_second": a.steps * BATCH / seconds, "seconds": seconds}, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as multigpu's ranks end: gloo's threads and persistent workers can hang a normal exit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--gen-wait", type=float, default=80.0, help="ms a generator waits per batch")
    p.add_argument("--width", type=float, default=2.0, help="scales the convnet's filter counts")
    p.add_argument("--multigpu", action="store_true")
    p.add_argument("--ddp", action="store_true")
    a = p.parse_args()
    ddp_run(a) if a.ddp else keras_run(a)


if __name__ == "__main__":
    main()
