"""Keras's own `keras.callbacks.BackupAndRestore` on a DistributedModel, in one process (p=1).

A fit interrupted by an exception is run again with the same callback and must end with the
weights and optimizer state of an uninterrupted fit, bit for bit, with `save_freq` "epoch" or a
number of steps; the relaunch starts at the step after the backup, where Keras itself would
restart the epoch. The weights file holds the optimizer's state as Keras keeps it: a plain Keras
model loads it, and the reverse. The multi-rank version, with real kills and `tfsmp run
--max-restarts`, is tests/mpi/test_resume.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.tf

EPOCHS, BATCH, SAMPLES = 3, 8, 48  # 6 steps per epoch


@pytest.fixture(scope="module")
def smp() -> Iterator[object]:
    import tfsmp

    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"partitions": 1, "microbatches": 2, "seed": 5})
    yield tfsmp
    tfsmp.shutdown()


def _model() -> keras.Model:
    keras.utils.set_random_seed(2)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="d0")(x)
    return keras.Model(x, keras.layers.Dense(1, name="out")(h), name="net")


def _dm(smp: object) -> object:
    dm = smp.DistributedModel(_model())  # type: ignore[attr-defined]
    dm.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return dm


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype(np.float32)
    return x, np.sin(x[:, :1]).astype(np.float32)


class _Stop(keras.callbacks.Callback):  # type: ignore[misc]
    """Raises before global step ``at``; records the first step of each fit."""

    def __init__(self, at: int | None = None) -> None:
        super().__init__()
        self.at, self.seen, self.epoch, self.first = at, 0, 0, None

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        if self.first is None:
            self.first = (self.epoch, batch)
        if self.at is not None and self.epoch * (SAMPLES // BATCH) + batch == self.at:
            raise RuntimeError("interrupted")


def _state(dm: object) -> list[np.ndarray]:
    return [*dm.get_weights(), *(v.numpy() for v in dm.optimizer.variables)]  # type: ignore[attr-defined]


def _fit(dm: object, callbacks: list[object]) -> object:
    x, y = _data()
    return dm.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,  # type: ignore[attr-defined]
                  callbacks=callbacks)


@pytest.fixture(scope="module")
def uninterrupted(smp: object) -> list[np.ndarray]:
    dm = _dm(smp)
    _fit(dm, [])
    return _state(dm)


@pytest.mark.parametrize(("save_freq", "stop_at", "resumes_at"), [
    ("epoch", 9, (1, 0)),   # the epoch-0 backup; step 9 is in epoch 1
    (4, 9, (1, 2)),         # backups after global steps 3 and 7; 7 is batch 1 of epoch 1
    (4, 3, (0, 0)),         # no backup yet: from the start
])
def test_an_interrupted_fit_resumes_after_the_backup_and_ends_as_if_uninterrupted(
        smp: object, uninterrupted: list[np.ndarray], tmp_path: Path, save_freq: object,
        stop_at: int, resumes_at: tuple[int, int]) -> None:
    backup = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_dm(smp), [keras.callbacks.BackupAndRestore(str(backup), save_freq=save_freq),
                        _Stop(stop_at)])
    dm, stop = _dm(smp), _Stop()
    history = _fit(dm, [keras.callbacks.BackupAndRestore(str(backup), save_freq=save_freq), stop])
    assert stop.first == resumes_at
    assert len(history.history["loss"]) == EPOCHS - resumes_at[0]  # type: ignore[attr-defined]
    assert not backup.exists()  # deleted when fit completed, as Keras does
    state = _state(dm)
    assert len(state) == len(uninterrupted)
    assert all(np.array_equal(a, b) for a, b in zip(state, uninterrupted))


def test_keras_metadata_cut_short_by_a_kill_is_rewritten_from_the_weights_file(
        smp: object, uninterrupted: list[np.ndarray], tmp_path: Path) -> None:
    # A rank killed while writing training_metadata.json leaves it empty beside a complete
    # weights file; Keras alone would fail to parse it (and would restart the epoch anyway).
    backup = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_dm(smp), [keras.callbacks.BackupAndRestore(str(backup), save_freq=4), _Stop(9)])
    (backup / "training_metadata.json").write_text("")
    dm, stop = _dm(smp), _Stop()
    _fit(dm, [keras.callbacks.BackupAndRestore(str(backup), save_freq=4, delete_checkpoint=False),
              stop])
    assert stop.first == (1, 2)
    assert all(np.array_equal(a, b) for a, b in zip(_state(dm), uninterrupted))
    # the last backup (after global step 15, batch 3 of epoch 2) names its place as an
    # uninterrupted run's would: Keras's counters were set on resume
    assert json.loads((backup / "training_metadata.json").read_text()) == {"epoch": 2, "batch": 3}


def test_the_weights_file_holds_the_optimizer_state_as_keras_keeps_it(
        smp: object, tmp_path: Path) -> None:
    x, y = _data()
    dm = _dm(smp)
    dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # type: ignore[attr-defined]
    dm.save_weights(str(tmp_path / "dm.weights.h5"))  # type: ignore[attr-defined]
    plain = _model()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(str(tmp_path / "dm.weights.h5"))
    assert int(plain.optimizer.iterations.numpy()) == SAMPLES // BATCH
    mine = {v.name: v.numpy() for v in dm.optimizer.variables}  # type: ignore[attr-defined]
    theirs = {v.name: v.numpy() for v in plain.optimizer.variables}
    assert sorted(mine) == sorted(theirs)
    assert all(np.array_equal(mine[k], theirs[k]) for k in mine)
    # and back: a plain Keras weights file restores the DistributedModel's optimizer at partitioning
    plain.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    plain.save_weights(str(tmp_path / "plain.weights.h5"))
    again = _dm(smp)
    again.load_weights(str(tmp_path / "plain.weights.h5"))  # type: ignore[attr-defined]
    again.partition(x[:BATCH])  # type: ignore[attr-defined]
    theirs = {v.name: v.numpy() for v in plain.optimizer.variables}
    mine = {v.name: v.numpy() for v in again.optimizer.variables}  # type: ignore[attr-defined]
    assert sorted(mine) == sorted(theirs)
    assert all(np.array_equal(mine[k], theirs[k]) for k in mine)


def test_a_wrapped_built_model_is_built(smp: object) -> None:
    dm = _dm(smp)
    assert dm.built  # type: ignore[attr-defined]
