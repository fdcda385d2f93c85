"""Each rank's share of every global batch, for every input form (in one process, one planner per rank)."""

import glob
import os
import time
import uuid

import keras
import numpy as np
import pytest
import torch

from multigpu.data.exchange import directory
from multigpu.data.forms import input_kind, num_rows, validation_split
from multigpu.data.host import Host
from multigpu.data.sources import source_for
from multigpu.data.streams import StreamSource
from multigpu.keras.data import ShardedData
from multigpu.planning import StepPlanner, split

RATIOS = [3.0, 1.0]


def planners(ratios=RATIOS):
    return [StepPlanner(lambda total: split(total, ratios), rank) for rank in range(len(ratios))]


def hosts(n=2, run=None):
    """``n`` ranks of one machine, as one process plays them (their files named apart from any other test's)."""
    run = run or uuid.uuid4().hex[:8]
    return [Host(r, f"rank {r}", r, n, 1, run, 7) for r in range(n)]


def host():
    return hosts(1)[0]


def batches(data: ShardedData, epoch: int = 0) -> list:
    data.set_epoch(epoch)
    data.on_epoch_begin()
    out = [keras.tree.map_structure(lambda a: None if a is None else np.asarray(a), b)
           for b in data.get_torch_dataloader()]
    data.on_epoch_end()
    return out


@pytest.mark.parametrize("shuffle", [False, True, "batch"])
def test_arrays_every_row_once_per_epoch_in_contiguous_shares(shuffle):
    x = np.arange(70, dtype="float64").reshape(35, 2)
    y = np.arange(35)
    per_rank = [batches(ShardedData(source_for(x, y, None, 16, shuffle, 7, "fit", host()), p, training=True))
                for r, p in enumerate(planners())]
    assert len(per_rank[0]) == len(per_rank[1]) == 3  # 16, 16, 3 rows
    rows = []
    for step in range(3):
        (x0, y0), (_, y1) = per_rank[0][step], per_rank[1][step]
        assert x0.dtype == np.float32  # floats become floatx, as Keras does
        assert (len(y0), len(y1)) == ((12, 4) if step < 2 else (2, 1))
        rows += list(y0) + list(y1)
        if shuffle == "batch":
            assert set(y0) | set(y1) == set(range(16 * step, min(16 * step + 16, 35)))
    assert sorted(rows) == list(range(35))
    assert (rows == list(range(35))) == (shuffle is False)


def test_every_rank_draws_the_same_order_from_the_shared_seed_and_a_new_one_each_epoch():
    x = np.arange(40).reshape(40, 1).astype("float32")
    a = ShardedData(source_for(x, None, None, 40, True, 3, "fit", host()), planners()[0], training=False)
    b = ShardedData(source_for(x, None, None, 40, True, 3, "fit", host()), planners()[1], training=False)
    first_a, first_b = batches(a, 0), batches(b, 0)
    assert sorted(np.concatenate([first_a[0], first_b[0]]).ravel()) == list(range(40))
    assert not np.array_equal(batches(a, 0)[0], batches(a, 1)[0])


def test_training_batches_queue_their_plans_for_the_step_and_a_peek_is_forgotten():
    p0 = planners()[0]
    data = ShardedData(source_for(np.zeros((20, 1), "float32"), None, None, 8, False, 0, "fit", host()), p0,
                       training=True)
    data.set_epoch(0)
    data.on_epoch_begin()
    next(iter(data.get_torch_dataloader()))  # Keras peeks at one batch to build the model
    data.on_epoch_end()
    data.on_epoch_begin()  # the epoch proper: the peek's plan is gone
    it = iter(data.get_torch_dataloader())
    for expected in (6, 6, 3):
        xb = next(it)  # x alone, as Keras packs data without targets
        assert p0.take(len(xb)).local == expected


def test_structures_dicts_and_torch_tensors_are_cut_alike():
    x = {"a": np.ones((10, 3), "float32"), "b": torch.arange(10).reshape(10, 1)}
    y = [np.arange(10), np.arange(10) * 2]
    assert num_rows(x, y) == 10 and input_kind(x) == "arrays"
    source = source_for(x, y, None, 10, False, 0, "fit", host())
    [(xb, yb)] = batches(ShardedData(source, planners()[1], training=False))
    assert xb["a"].shape == (2, 3) and list(xb["b"].ravel()) == [8, 9] and list(yb[1]) == [16, 18]


def lockstep(datas):
    """Every rank's batches of one pass, taken in turn as the ranks of one machine would."""
    for d in datas:
        d.set_epoch(0)
        d.on_epoch_begin()
    iterators = [d.get_numpy_iterator() for d in datas]
    out = [[] for _ in datas]
    try:
        while True:
            for r, it in enumerate(iterators):
                out[r].append(keras.tree.map_structure(np.asarray, next(it)))
    except StopIteration:
        pass
    for it in iterators:
        it.close()
    return out


class Batches(keras.utils.PyDataset):
    def __init__(self, n=5, rows=8, fail_at=None, **kwargs):
        super().__init__(**kwargs)
        self.n, self.rows, self.fail_at, self.reads = n, rows, fail_at, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads.append(i)
        if i == self.fail_at:
            raise OSError(f"cannot read batch {i}")
        rows = np.arange(self.rows * i, self.rows * i + self.rows)
        return {"x": rows[:, None].astype("float32")}, rows


def no_files_left(run):
    return not glob.glob(os.path.join(directory(), f"multigpu-in-{run}-*"))


@pytest.mark.parametrize("workers", [1, 3])
def test_pydataset_batches_are_read_once_per_machine_and_cut_by_share(workers):
    datasets = [Batches(workers=workers), Batches(workers=workers)]
    assert input_kind(datasets[0]) == "pydataset"
    machine = hosts()
    datas = [ShardedData(source_for(ds, None, None, None, False, 0, "fit", h), p, training=False)
             for ds, h, p in zip(datasets, machine, planners())]
    cut = lockstep(datas)
    assert [list(b[1]) for b in cut[1]] == [[8 * i + 6, 8 * i + 7] for i in range(5)]
    assert [list(b[1]) for b in cut[0]] == [list(range(8 * i, 8 * i + 6)) for i in range(5)]
    assert cut[0][0][0]["x"].shape == (6, 1)
    # the ranks took turns: each global batch was read by one rank only
    assert sorted(datasets[0].reads + datasets[1].reads) == list(range(5))
    assert sorted(datasets[0].reads) == [0, 2, 4]
    assert no_files_left(machine[0].run)


def test_a_shuffled_pydataset_gives_every_batch_once_in_the_shared_order():
    machine = hosts()
    datas = [ShardedData(source_for(Batches(n=7), None, None, None, True, 3, "fit", h), p, training=False)
             for h, p in zip(machine, planners())]
    cut = lockstep(datas)
    firsts = [int(b[1][0]) // 8 for b in cut[0]]
    assert sorted(firsts) == list(range(7)) and firsts != list(range(7))
    assert [int(b[1][0]) // 8 for b in cut[1]] == firsts


def test_a_reading_error_reaches_every_rank_naming_the_reader():
    machine = hosts()
    datas = [ShardedData(source_for(Batches(fail_at=3), None, None, None, False, 0, "fit", h), p, training=False)
             for h, p in zip(machine, planners())]
    with pytest.raises(RuntimeError, match=r"batch 3 of this pass failed on rank 1: OSError: cannot read batch 3"):
        lockstep(datas)
    datas[1].close()


def test_a_generator_is_read_by_one_rank_and_a_peeked_batch_is_given_again():
    machine = hosts()
    made = []

    def gen(tag):
        for i in range(4):
            made.append(tag)
            yield np.full((8, 1), i, "float32"), np.arange(8) + 8 * i

    sources = [source_for(gen(r), None, None, None, False, 0, "fit", h) for r, h in enumerate(machine)]
    datas = [ShardedData(s, p, training=True) for s, p in zip(sources, planners())]
    peeks = [next(d.get_numpy_iterator()) for d in datas]  # Keras takes one batch to build the model
    assert [len(b[1]) for b in peeks] == [6, 2]
    cut = lockstep(datas)
    assert [list(b[1]) for b in cut[1]] == [[6, 7], [14, 15], [22, 23], [30, 31]]
    assert set(made) == {0}  # only local rank 0's generator was read
    for d in datas:
        d.close()
    assert no_files_left(machine[0].run)


class _Sums:
    """``sum_floats`` between threads that play the ranks of several machines."""

    def __init__(self, world: int) -> None:
        import threading

        self.world_size, self.lock, self.rows = world, threading.Lock(), []
        self.summed = threading.Barrier(world, action=self._total)
        self.read = threading.Barrier(world)

    def _total(self):
        self.total = list(np.sum(self.rows, axis=0))
        self.rows = []

    def sum_floats(self, values, what=""):
        with self.lock:
            self.rows.append(list(values))
        self.summed.wait(timeout=30)
        total = self.total
        self.read.wait(timeout=30)
        return total


@pytest.mark.parametrize("same_order", [True, False])
def test_machines_whose_copies_give_other_batches_are_told_once(same_order, recwarn):
    """Two machines of one rank each read their own copy of a stream; copies in other orders (an unseeded
    shuffle) are found at the first batch and said once, by rank 0; copies in the same order say nothing."""
    import threading

    run, comm = uuid.uuid4().hex[:8], _Sums(2)
    machines = [Host(r, f"rank {r}", 0, 1, 2, run, 7, comm) for r in range(2)]

    def gen(machine):
        order = range(4) if same_order or machine == 0 else (1, 0, 3, 2)
        for i in order:
            yield np.full((8, 1), i, "float32"), np.arange(8) + 8 * i

    sources = [StreamSource(gen(r), h) for r, h in enumerate(machines)]
    datas = [ShardedData(s, p, training=True) for s, p in zip(sources, planners())]
    got = [None, None]

    def play(r):
        datas[r].set_epoch(0)
        datas[r].on_epoch_begin()
        got[r] = [keras.tree.map_structure(np.asarray, b) for b in datas[r].get_numpy_iterator()]

    threads = [threading.Thread(target=play, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for d in datas:
            d.close()
    assert no_files_left(run)
    assert [len(g) for g in got] == [4, 4]
    told = [str(w.message) for w in recwarn if "differs between machines" in str(w.message)]
    if same_order:
        assert told == []
    else:
        assert len(told) == 1 and "global batch 0 differs between machines (rank(s) [1]" in told[0], told


def test_a_slow_start_reads_two_batches_of_a_pass_keras_only_peeks_into():
    """A tf.data pass Keras opens to build the model and leaves after one batch is read two batches deep, as
    Keras reads it (a deeper read-ahead would move the state a dataset's iterators share); a pass the ranks
    take from is read ahead to the full depth."""
    machine = hosts()
    reads = []

    class Counted:
        def __iter__(self):
            for i in range(12):
                reads.append(i)
                yield np.full((8, 1), i, "float32"), np.arange(8)

    def sources(slow_start):
        return [StreamSource(Counted(), h, slow_start=slow_start) for h in machine]

    for slow_start in (2, 0):
        reads.clear()
        datas = [ShardedData(s, p, training=True) for s, p in zip(sources(slow_start), planners())]
        peeks = [d.get_numpy_iterator() for d in datas]
        assert [len(next(it)[1]) for it in peeks] == [6, 2]
        time.sleep(0.5)  # time for the reader to read as far as it may
        assert len(reads) == 2 if slow_start else len(reads) > 2, reads
        for it in peeks:
            it.close()
        for d in datas:
            d.close()
    datas = [ShardedData(s, p, training=True) for s, p in zip(sources(2), planners())]
    assert [len(b) for b in lockstep(datas)] == [12, 12]  # a pass that is taken from reads on
    for d in datas:
        d.close()
    assert no_files_left(machine[0].run)


def test_a_dataloader_loads_only_each_ranks_indices_with_its_workers():
    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 27

        def __getitem__(self, i):
            return torch.tensor([float(i)]), i

    class Comm:  # every rank drew the same batches
        def gather_objects(self, obj, what=""):
            return [obj, obj]

    loaders = [torch.utils.data.DataLoader(Items(), batch_size=8, shuffle=True, num_workers=2,
                                           generator=torch.Generator().manual_seed(4)) for _ in range(2)]
    from multigpu.data.loader import LoaderSource

    sources = [LoaderSource(loader, Comm(), r) for r, loader in enumerate(loaders)]
    got = [[], []]
    for r, (s, p) in enumerate(zip(sources, planners())):
        for batch in s.batches(p.plan):
            got[r].append([int(v) for v in batch[1]])
            assert p.take(len(batch[1])).local == len(batch[1])
    assert [len(b) for b in got[0]] == [6, 6, 6, 2] and [len(b) for b in got[1]] == [2, 2, 2, 1]
    rows = [i for step in zip(got[0], got[1]) for part in step for i in part]
    assert sorted(rows) == list(range(27)) and rows != list(range(27))
    one_device = [int(i) for _, ys in torch.utils.data.DataLoader(
        Items(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(4)) for i in ys]
    assert rows == one_device  # the same global batches, in the same order, as one device draws


def test_bad_inputs_say_what_was_received():
    with pytest.raises(ValueError, match=r"same number of rows. Received row counts x: \[10\], y: \[9\]"):
        num_rows(np.zeros((10, 2)), np.zeros(9))
    with pytest.raises(TypeError, match="Received: x of type str"):
        source_for("data.csv", None, None, 8, False, 0, "fit", host())
    with pytest.raises(TypeError, match="`y` and `sample_weight` must be NumPy arrays"):
        source_for(np.zeros((4, 1)), [1, 2, 3, 4], None, 8, False, 0, "fit", host())
    with pytest.raises(ValueError, match="not sufficient to split"):
        validation_split((np.zeros((1, 1)),), 0.5)


def test_validation_split_takes_the_last_rows_as_keras_does():
    (_, ty), (_, vy) = validation_split((np.arange(10)[:, None], np.arange(10)), 0.2)
    assert list(ty) == list(range(8)) and list(vy) == [8, 9]


def test_a_dataloader_over_keys_that_are_not_integers_is_cut_the_same_way():
    from multigpu.data.loader import LoaderSource

    class Named(torch.utils.data.Dataset):
        def __getitem__(self, key):
            return torch.tensor([float(int(key[1:]))]), int(key[1:])

        def __len__(self):
            return 10

    class Comm:
        def gather_objects(self, obj, what=""):
            return [obj, obj]

    keys = [[f"k{i}" for i in range(j, min(j + 4, 10))] for j in range(0, 10, 4)]
    loaders = [torch.utils.data.DataLoader(Named(), batch_sampler=keys) for _ in range(2)]
    got = []
    for r, (loader, p) in enumerate(zip(loaders, planners())):
        got.append([[int(v) for v in b[1]] for b in LoaderSource(loader, Comm(), r).batches(p.plan)])
    assert got == [[[0, 1, 2], [4, 5, 6], [8]], [[3], [7], [9]]]  # 2 rows at 3:1: one each
