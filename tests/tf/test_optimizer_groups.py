"""Optimizers that apply through others (a LossScaleOptimizer, Keras's MultiOptimizer) keep their
whole state in a `DistributedModel`'s weights file and checkpoints, in one process (p=1).

Each writes its global variables (iteration count, learning rate) once per optimizer, all named
alike; tfsmp keyed them by name alone, so neither optimizer's state could be saved: a weights
file held none (a warning) and a checkpoint raised "two named 'iteration'" ([Note: slot keys] in
tfsmp/checkpoint/layout.py). A weights file also has a group of its own per inner optimizer
(``optimizer/inner_optimizer/vars``, ``optimizer/optimizers/adam/vars``), which tfsmp now writes
as Keras's own saving walk lays it out (`keras_groups` in tfsmp/checkpoint/keras_optimizer.py).
The two-rank MultiOptimizer cases are in tests/mpi/scripts/trainer_cases.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
h5py = pytest.importorskip("h5py")
pytestmark = pytest.mark.tf


def _model() -> Any:
    keras.utils.set_random_seed(1)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="enc0")(x)
    return keras.Model(x, keras.layers.Dense(2, name="dec0")(h))


def _multi() -> Any:
    mapping = keras.optimizers.OptimizerMap(keras.optimizers.SGD(0.05, momentum=0.9))
    mapping["enc.*"] = keras.optimizers.Adam(0.01)
    return keras.optimizers.MultiOptimizer(mapping)


OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
    "multi": _multi,
}


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 6)).astype(np.float32), rng.normal(size=(32, 2)).astype(np.float32)


def _contents(path: Path) -> dict[str, tuple[Any, dict[str, str]]]:
    """Every group and dataset: its array (None for a group) and its attributes, tfsmp's
    checksums left out."""
    out: dict[str, tuple[Any, dict[str, str]]] = {}

    def visit(name: str, obj: Any) -> None:
        attrs = {k: str(v) for k, v in obj.attrs.items() if not k.startswith("tfsmp_")}
        out[name] = (obj[()] if isinstance(obj, h5py.Dataset) else None, attrs)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_weights_file_is_keras_own_with_every_optimizers_group(
        smp: Any, tmp_path: Path, name: str) -> None:
    x, y = _data()
    plain = _model()
    plain.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    plain.save_weights(tmp_path / "plain.weights.h5")
    dm = smp.DistributedModel(_model())
    dm.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    dm.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*optimizer state.*")
        dm.save_weights(tmp_path / "dm.weights.h5")
    want, got = _contents(tmp_path / "plain.weights.h5"), _contents(tmp_path / "dm.weights.h5")
    assert sorted(got) == sorted(want)
    if name != "adam":  # the inner optimizers' own groups, named as Keras names them
        assert any(k.startswith(("optimizer/inner_optimizer/vars", "optimizer/optimizers/adam/"))
                   for k in got)
    for key, (array, attrs) in want.items():
        # the name attribute is the optimizer's own name (its instance number differs)
        got_attrs = {k: v.rstrip("_0123456789") for k, v in got[key][1].items()}
        assert got_attrs == {k: v.rstrip("_0123456789") for k, v in attrs.items()}, key
        if array is not None:
            np.testing.assert_allclose(got[key][0], array, rtol=1e-6, atol=1e-7, err_msg=key)
    # and it loads into plain Keras with the whole optimizer state, without Keras's warnings
    fresh = _model()
    fresh.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Skipping variable loading.*")
        fresh.load_weights(tmp_path / "dm.weights.h5")
    for a, b in zip(fresh.optimizer.variables, plain.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                   err_msg=str(b.path))


@pytest.mark.parametrize("name", ["loss_scale", "multi"])
def test_a_checkpoint_restores_every_optimizers_state(smp: Any, tmp_path: Path, name: str
                                                      ) -> None:
    import tensorflow as tf

    x, y = _data()
    dm = smp.DistributedModel(_model())
    dm.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    dm.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    smp.CheckpointManager(tf.train.Checkpoint(model=dm, optimizer=dm.optimizer),
                          directory=str(tmp_path / "ckpts")).save()
    again = smp.DistributedModel(_model())
    again.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    smp.CheckpointManager(tf.train.Checkpoint(model=again, optimizer=again.optimizer),
                          directory=str(tmp_path / "ckpts")).restore()
    again.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)  # applies it
    dm.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(again.optimizer.variables, dm.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(b.path))
    # the restored count went on: 2 epochs of 4 steps, then one (a LossScaleOptimizer's own
    # count stays 0 in Keras; its inner optimizer counts)
    iterations = [int(np.asarray(v)) for v in again.optimizer.variables if v.name == "iteration"]
    assert max(iterations) == 2 * 4 + 1, iterations
