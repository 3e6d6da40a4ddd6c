"""Weights at the step's end: with several microbatches, a stage's linear layers keep no gradient
accumulator, and training equals plain Keras ([Note: weights at the step's end] in
tfsmp/runtime/stage.py)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

import tfsmp as smp

pytestmark = pytest.mark.tf

STEPS, BATCH, WIDTH = 3, 8, 64
# Adam divides by sqrt(v): a near-zero gradient's float rounding (any summation order, the
# accumulating path's too) moves its weight by up to a few 1e-6 in 3 steps
RTOL, ATOL = 1e-5, 5e-6


def _model() -> Any:
    x = keras.Input((WIDTH,), name="x")
    h = x
    for i in range(3):
        h = keras.layers.Dense(WIDTH, activation="relu" if i < 2 else None, name=f"d{i}",
                               kernel_initializer=keras.initializers.GlorotUniform(seed=i))(h)
    h = keras.layers.LayerNormalization(name="norm")(h)  # not linear: keeps its accumulators
    return keras.Model(x, h)


def _optimizer(name: str, **kw: Any) -> Any:
    return keras.optimizers.Adam(1e-3, **kw) if name == "adam" else keras.optimizers.SGD(0.1, **kw)


def _train(m: int | None, opt: str, batch: int = BATCH, optimize: str = "memory",
           xla: bool = False, **kw: Any) -> tuple[list[Any], Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * batch, WIDTH)).astype("float32")
    y = rng.standard_normal((STEPS * batch, WIDTH)).astype("float32")
    model = _model()
    if m is None:  # plain Keras
        model.compile(optimizer=_optimizer(opt, **kw), loss="mse", jit_compile=xla)
        engine = None
    else:
        if smp.is_initialized():
            smp.shutdown()
        smp.init({"partitions": 1, "microbatches": m, "optimize": optimize})
        model = smp.DistributedModel(model)
        model.compile(optimizer=_optimizer(opt, **kw), loss="mse", jit_compile=xla)
    for i in range(STEPS):
        model.train_on_batch(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch])
    if m is not None:
        engine = model._engine
    return model.get_weights(), engine


@pytest.mark.parametrize(("m", "opt", "optimize", "xla"), [
    (2, "adam", "memory", False), (4, "sgd", "memory", False), (8, "adam", "memory", False),
    (4, "adam", "speed", False),
    # XLA stage programs (compile(jit_compile=True), against plain Keras compiled so): the same
    # (until 2026-12-06 they kept accumulators, docs/memory.md)
    (4, "adam", "memory", True), (2, "sgd", "speed", True)])
def test_late_weights_equal_plain_keras_and_keep_no_linear_accumulator(m: int, opt: str,
                                                                        optimize: str,
                                                                        xla: bool) -> None:
    want, _ = _train(None, opt, xla=xla)
    got, engine = _train(m, opt, optimize=optimize, xla=xla)
    try:
        assert engine.compiles_with_xla() is xla
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
        prog = engine.programs[0]
        assert prog.late
        shapes = [tuple(a.shape) for a in prog.accumulators]
        names = [v.path for v in prog.trainable]
        for name, shape, v in zip(names, shapes, prog.trainable):
            linear = name.startswith("d")
            assert (shape == (0,)) is linear, (name, shape)  # only LayerNormalization keeps one
            if not linear:
                assert shape == tuple(v.shape)
    finally:
        smp.shutdown()


def test_clipnorm_and_large_batches_keep_accumulators() -> None:
    want, _ = _train(None, "adam", clipnorm=0.5)
    got, engine = _train(4, "adam", clipnorm=0.5)  # clipping would see the stand-ins
    try:
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
        assert not engine.programs[0].late
        assert all(tuple(a.shape) == tuple(v.shape)
                   for a, v in zip(engine.programs[0].accumulators, engine.programs[0].trainable))
        # 1024 rows: the linear layers' inputs and gradients (1024 x 64 x 2 floats each) outweigh
        # their weights (64 x 64): accumulators are smaller ([Note: weights at the step's end])
        _, engine = _train(4, "adam", batch=1024)
        assert not engine.programs[0].late
    finally:
        smp.shutdown()


def test_the_store_counts_changes_of_its_variables_only() -> None:
    """[Note: traced accumulators]: a stage retraces its programs when this count moves (the
    behaviour itself, a compile at partitions=2: tests/mpi/test_keras_trainer.py)."""
    import tensorflow as tf

    from tfsmp.runtime.gradients import GradientStore

    store = GradientStore(0, [tf.Variable(np.zeros((3, 2), np.float32)),
                              tf.Variable(np.zeros(2, np.float32))])
    first = list(store.accumulators)
    g = store.generation
    store.ensure_accumulators()  # the same variables: no change
    assert store.generation == g and all(a is b for a, b in zip(store.accumulators, first))
    store.ensure_accumulators(frozenset({0}))  # a placeholder replaces the first
    assert store.generation == g + 1 and store.accumulators[1] is first[1]
    store.drop_accumulators()
    assert store.generation == g + 2 and store.accumulators == []
    store.drop_accumulators()  # nothing to drop
    assert store.generation == g + 2
