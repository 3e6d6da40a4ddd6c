"""Keras's saving functions and pickling handed a `DistributedModel`, in one process (p=1).

The two-rank versions (a partitioned model: gathered weights, rank 0 writes, collective
pickling) are `case_keras_saving_functions_m2` and `case_pickle_m2` in
tests/mpi/scripts/trainer_cases.py.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.tf


def _model(seed: int = 1) -> Any:
    keras.utils.set_random_seed(seed)
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="d0")(x)
    return keras.Model(x, keras.layers.Dense(2, name="out")(h))


def _x() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(8, 4)).astype("float32")


def test_pickling_before_partitioning_needs_no_other_rank(smp: Any) -> None:
    dm = smp.DistributedModel(_model())
    dm.compile(optimizer="adam", loss="mse")
    back = pickle.loads(pickle.dumps(dm))  # local: every variable is still here
    assert type(back).__name__ == "DistributedModel" and back.name == dm.name
    assert back.compiled and back.rank_view is None
    np.testing.assert_allclose(back.wrapped.predict(_x(), verbose=0),
                               dm.wrapped.predict(_x(), verbose=0))


def test_get_config_is_the_wrapped_models_and_from_config_wraps_again(smp: Any) -> None:
    dm = smp.DistributedModel(_model())
    config = keras.saving.serialize_keras_object(dm)
    assert config["registered_name"] == "tfsmp>DistributedModel"
    assert config["config"]["model"]["class_name"] == "Functional"
    clone = keras.models.clone_model(dm)
    assert isinstance(clone, smp.DistributedModel) and clone.wrapped is not dm.wrapped


def test_a_file_object_gets_plain_keras_archive(smp: Any) -> None:
    from keras.src.saving import saving_lib

    dm = smp.DistributedModel(_model())
    dm.compile(optimizer="adam", loss="mse")
    dm.fit(_x(), _x()[:, :2], batch_size=4, verbose=0)
    buffer = io.BytesIO()
    saving_lib.save_model(dm, buffer)
    buffer.seek(0)
    plain = saving_lib.load_model(buffer)
    assert type(plain).__name__ == "Functional" and plain.compiled
    assert int(plain.optimizer.iterations.numpy()) == 2
    np.testing.assert_allclose(plain.predict(_x(), verbose=0), dm.predict(_x(), verbose=0),
                               rtol=1e-6)


def test_plain_models_still_take_keras_own_path(smp: Any, tmp_path: Any) -> None:
    from keras.src.saving import saving_lib

    smp.DistributedModel(_model())  # the dispatch is installed
    plain = _model()
    saving_lib.save_model(plain, str(tmp_path / "p.keras"))
    assert saving_lib.save_model.__name__ == "save_model"
    np.testing.assert_allclose(keras.models.load_model(str(tmp_path / "p.keras")).predict(
        _x(), verbose=0), plain.predict(_x(), verbose=0))


@pytest.mark.parametrize("call,match", [
    (lambda lib, dm, p: lib.save_model(dm, p + ".keras", zipped=False), "without `zipped`"),
    (lambda lib, dm, p: lib.save_weights_only(dm, p + ".weights.h5", max_shard_size=1),
     "without `max_shard_size`"),
    (lambda lib, dm, p: lib.save_model(dm, p + ".pb"), "expected a `.keras` extension"),
])
def test_what_a_distributed_model_cannot_save_is_refused(smp: Any, tmp_path: Any, call: Any,
                                                         match: str) -> None:
    from keras.src.saving import saving_lib

    dm = smp.DistributedModel(_model())
    with pytest.raises(ValueError, match=match):
        call(saving_lib, dm, str(tmp_path / "m"))
