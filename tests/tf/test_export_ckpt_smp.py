"""SMP-script checkpoint and export behaviour in one process (p=1): restores with nothing to
restore, restores and loads before the first step, `save_model` of SMP's usual subclass fed
float64, and ``model.save("m.h5")``. The 2-stage versions are in
`tests/mpi/test_aws_checkpoint_scripts.py`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tfsmp.errors import CheckpointError

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
pytestmark = pytest.mark.tf

RTOL, ATOL = 1e-5, 1e-6  # float32 equality, as the runtime equality tests


@pytest.fixture(scope="module")
def smp() -> Iterator[object]:
    import tfsmp

    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"partitions": 1, "microbatches": 2})
    yield tfsmp
    tfsmp.shutdown()


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="d0")(x)
    return keras.Model(x, keras.layers.Dense(3, name="head")(h), name="net")


def _dm(smp: object, seed: int, loss: object = "mse") -> object:
    dm = smp.DistributedModel(_model(seed))  # type: ignore[attr-defined]
    dm.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    return dm


def _data(seed: int = 0, dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(8, 6)).astype(dtype), rng.normal(size=(8, 3)).astype(dtype)


def _manager(smp: object, dm: object, directory: Path, **extras: object) -> object:
    ckpt = tf.train.Checkpoint(model=dm, optimizer=dm.optimizer, **extras)
    return smp.CheckpointManager(ckpt, directory=str(directory))  # type: ignore[attr-defined]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


# -- restore with nothing to restore (SMP: a warning, no change) --------------------------------

def test_restore_with_no_checkpoint_logs_and_changes_nothing(
        smp: object, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dm = _dm(smp, seed=1)
    before = dm.get_weights()
    manager = _manager(smp, dm, tmp_path / "empty")
    with caplog.at_level(logging.WARNING, logger="tfsmp.checkpoint"):
        assert manager.restore() is None
        assert manager.restore("ckpt-2") is None  # tf2_checkpoint_test.py: before it is saved
    messages = [r.getMessage() for r in caplog.records]
    assert any("No checkpoint restored: latest is not in" in m and "no checkpoints" in m
               for m in messages), messages
    assert any("No checkpoint restored: 'ckpt-2'" in m for m in messages), messages
    _same(dm.get_weights(), before)


def test_restore_of_something_else_still_fails(smp: object, tmp_path: Path) -> None:
    tf.train.Checkpoint(v=tf.Variable(1.0)).save(str(tmp_path / "tf" / "ckpt"))
    dm = _dm(smp, seed=1)
    with pytest.raises(CheckpointError, match=r"restore_prefix must name a complete checkpoint"):
        _manager(smp, dm, tmp_path / "tf").restore("ckpt-1")


# -- restore and load before the first step are visible at once ---------------------------------

def test_restore_before_the_first_step_is_visible_then_resumes(smp: object, tmp_path: Path
                                                               ) -> None:
    saved = _dm(smp, seed=1)
    for i in range(2):
        saved.train_on_batch(*_data(i))
    _manager(smp, saved, tmp_path, epoch=tf.Variable(3.0)).save()
    assert (tmp_path / "mp_rank_0" / "checkpoint").read_text().startswith(
        'model_checkpoint_path: "../ckpt-1"')  # SMP's layout, as a marker
    want = saved.get_weights()
    fresh, epoch = _dm(smp, seed=2), tf.Variable(0.0)
    _manager(smp, fresh, tmp_path, epoch=epoch).restore()
    _same(fresh.get_weights(), want)
    _same([v.numpy() for v in fresh.wrapped.weights], want)
    assert float(epoch.numpy()) == 3.0
    fresh.save(str(tmp_path / "early.keras"))  # a file written before the first step
    _same(keras.models.load_model(str(tmp_path / "early.keras")).get_weights(), want)
    for i in range(2, 4):  # the optimizer's state followed at partitioning
        np.testing.assert_allclose(float(fresh.train_on_batch(*_data(i))),
                                   float(saved.train_on_batch(*_data(i))), rtol=1e-6)
    for a, b in zip(fresh.get_weights(), saved.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_restore_before_the_first_step_of_an_unbuilt_subclass(smp: object, tmp_path: Path
                                                             ) -> None:
    """No variable exists before partitioning: all of it is restored right after."""
    L = keras.layers

    class Net(smp.DistributedModel):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.d1, self.d2 = L.Dense(4, name="d1"), L.Dense(2, name="d2")  # keys: layer names

        def call(self, x: object, training: object = None) -> object:
            return self.d2(self.d1(x))

    x = _data()[0]
    saved = Net()
    saved.partition(x)
    smp.CheckpointManager(tf.train.Checkpoint(model=saved), str(tmp_path)).save()  # type: ignore[attr-defined]
    fresh = Net()
    smp.CheckpointManager(tf.train.Checkpoint(model=fresh), str(tmp_path)).restore()  # type: ignore[attr-defined]
    fresh.partition(x)
    _same(fresh.get_weights(), saved.get_weights())


def test_load_weights_before_the_first_step_is_visible(smp: object, tmp_path: Path) -> None:
    source = _model(seed=4)
    source.save_weights(str(tmp_path / "w.weights.h5"))
    dm = _dm(smp, seed=5)
    dm.load_weights(str(tmp_path / "w.weights.h5"))
    _same(dm.get_weights(), source.get_weights())
    dm.set_weights([w * 0 for w in source.get_weights()])
    dm.partition(_data()[0])  # nothing left pending overwrites what the user set since
    _same(dm.get_weights(), [w * 0 for w in source.get_weights()])


# -- save_model: SMP's subclass, fed float64 -------------------------------------------------------

def test_save_model_of_an_smp_subclass_serves_float64(smp: object, tmp_path: Path) -> None:
    L = keras.layers

    class Net(smp.DistributedModel):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:  # as every SMP example: no arguments
            super().__init__()
            self.d1, self.d2 = L.Dense(8, activation="tanh"), L.Dense(3)

        def call(self, x: object, training: object = None) -> object:
            return self.d2(self.d1(x))

    x = _data(dtype="float64")[0]  # what `x / 255.0` gives an SMP script
    net = Net()
    net.partition(x)
    net.save_model(str(tmp_path / "serving"))
    w = net.get_weights()
    serving = tf.saved_model.load(str(tmp_path / "serving")).signatures["serving_default"]
    got = serving(tf.constant(x))["output_0"].numpy()
    np.testing.assert_allclose(got, np.tanh(x @ w[0] + w[1]) @ w[2] + w[3], rtol=1e-5, atol=1e-5)


def test_save_model_signature_takes_the_dtype_training_was_fed(smp: object, tmp_path: Path
                                                              ) -> None:
    dm = _dm(smp, seed=1)
    x, y = _data(dtype="float64")
    dm.train_on_batch(x, y)
    dm.save_model(str(tmp_path / "serving"))
    serving = tf.saved_model.load(str(tmp_path / "serving")).signatures["serving_default"]
    np.testing.assert_allclose(serving(tf.constant(x))["output_0"].numpy(), dm.predict(x),
                               rtol=1e-5, atol=1e-6)


# -- model.save("m.h5"): Keras's legacy HDF5 model file --------------------------------------------

def test_save_h5_opens_in_plain_keras_compiled(smp: object, tmp_path: Path) -> None:
    dm = _dm(smp, seed=1, loss=keras.losses.MeanSquaredError())
    x, y = _data()
    dm.train_on_batch(x, y)
    dm.save(str(tmp_path / "m.h5"))
    loaded = keras.models.load_model(str(tmp_path / "m.h5"))
    # float32 tolerance: some CPUs' product kernel rounds rows differently between Keras's predict
    # and the runtime's (an AMD EPYC host, 2026-12-06: 8.6e-7 relative at the most)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), dm.predict(x), rtol=RTOL, atol=ATOL)
    assert loaded.compiled and isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert float(loaded.optimizer.learning_rate.numpy()) == pytest.approx(0.05)
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), dm.evaluate(x, y, verbose=0),
                               rtol=1e-5)


def test_save_h5_with_a_loss_keras_cannot_read_back(smp: object, tmp_path: Path) -> None:
    dm = _dm(smp, seed=1, loss="mse")  # Keras 3.15 writes it, then cannot load its own file
    x, y = _data()
    dm.train_on_batch(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.save(str(tmp_path / "m.hdf5"))
    assert any("holds no compile arguments" in str(w.message) for w in caught)
    loaded = keras.models.load_model(str(tmp_path / "m.hdf5"))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), dm.predict(x), rtol=RTOL, atol=ATOL)
