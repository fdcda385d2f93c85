"""Each rank's share of every global batch, for every input form (in one process, one planner per rank)."""

import keras
import numpy as np
import pytest
import torch

from multigpu.keras.data import ShardedData, input_kind, num_rows, validation_split
from multigpu.keras.sources import source_for
from multigpu.planning import StepPlanner, split

RATIOS = [3.0, 1.0]


def planners(ratios=RATIOS):
    return [StepPlanner(lambda total: split(total, ratios), rank) for rank in range(len(ratios))]


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
    per_rank = [batches(ShardedData(source_for(x, y, None, 16, shuffle, 7, "fit", r), p, training=True))
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
    a = ShardedData(source_for(x, None, None, 40, True, 3, "fit", 0), planners()[0], training=False)
    b = ShardedData(source_for(x, None, None, 40, True, 3, "fit", 1), planners()[1], training=False)
    first_a, first_b = batches(a, 0), batches(b, 0)
    assert sorted(np.concatenate([first_a[0], first_b[0]]).ravel()) == list(range(40))
    assert not np.array_equal(batches(a, 0)[0], batches(a, 1)[0])


def test_training_batches_queue_their_plans_for_the_step_and_a_peek_is_forgotten():
    p0 = planners()[0]
    data = ShardedData(source_for(np.zeros((20, 1), "float32"), None, None, 8, False, 0, "fit", 0), p0,
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
    [(xb, yb)] = batches(ShardedData(source_for(x, y, None, 10, False, 0, "fit", 1), planners()[1], training=False))
    assert xb["a"].shape == (2, 3) and list(xb["b"].ravel()) == [8, 9] and list(yb[1]) == [16, 18]


def test_pydataset_and_generator_batches_are_cut_by_share():
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            rows = np.arange(8 * i, 8 * i + 8)
            return rows[:, None].astype("float32"), rows

    ds = Batches()
    assert input_kind(ds) == "pydataset"
    cut = [batches(ShardedData(source_for(ds, None, None, None, False, 0, "fit", r), p, training=False))
           for r, p in enumerate(planners())]
    assert [list(b[1]) for b in cut[1]] == [[6, 7], [14, 15], [22, 23]]

    def gen():
        for _ in range(2):
            yield np.ones((8, 1), "float32"), np.arange(8)

    with pytest.warns(UserWarning, match="every rank iterates its own copy"):
        source = source_for(gen(), None, None, None, False, 0, "fit", 0)
    got = batches(ShardedData(source, planners()[0], training=False))
    assert [len(b[1]) for b in got] == [6, 6]


def test_bad_inputs_say_what_was_received():
    with pytest.raises(ValueError, match=r"same number of rows. Received row counts x: \[10\], y: \[9\]"):
        num_rows(np.zeros((10, 2)), np.zeros(9))
    with pytest.raises(TypeError, match="Received: x of type str"):
        source_for("data.csv", None, None, 8, False, 0, "fit", 0)
    with pytest.raises(TypeError, match="`y` and `sample_weight` must be NumPy arrays"):
        source_for(np.zeros((4, 1)), [1, 2, 3, 4], None, 8, False, 0, "fit", 0)
    with pytest.raises(ValueError, match="not sufficient to split"):
        validation_split((np.zeros((1, 1)),), 0.5)


def test_validation_split_takes_the_last_rows_as_keras_does():
    (_, ty), (_, vy) = validation_split((np.arange(10)[:, None], np.arange(10)), 0.2)
    assert list(ty) == list(range(8)) and list(vy) == [8, 9]
