"""``keras.saving.save_model``/``save_weights`` are routed only while a parallel model lives (in-process)."""

import gc

import keras

from multigpu.keras.saving import route_public_saving


class _Holder:
    """Stands for a parallel model: anything a weak reference can follow."""


def test_the_route_lasts_as_long_as_the_last_parallel_model():
    own_model, own_weights = keras.saving.save_model, keras.saving.save_weights
    first, second = _Holder(), _Holder()
    route_public_saving(first, lambda m: False)
    route_public_saving(second, lambda m: False)
    routed = keras.saving.save_model
    assert routed is not own_model and keras.saving.save_weights is not own_weights
    assert keras.models.save_model is routed
    del first
    gc.collect()
    assert keras.saving.save_model is routed  # one parallel model is left
    del second
    gc.collect()
    assert keras.saving.save_model is own_model and keras.saving.save_weights is own_weights
    assert keras.models.save_model is own_model
