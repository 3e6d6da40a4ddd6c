"""The one-call step of a world of one (p=1, m=1, d=1): plain Keras's losses and weights, the
executor path's bit for bit, the non-finite rules, tracing, and the finiteness check's exactness
([Note: one-call step] in tfsmp/runtime/fused_step.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfsmp as smp
from tfsmp.errors import StepError
from tfsmp.runtime.fused_step import OneCallStep, all_finite

pytestmark = pytest.mark.tf

_SPEC = importlib.util.spec_from_file_location(
    "runtime_cases", Path(__file__).parents[1] / "mpi" / "scripts" / "runtime_cases.py")
cases: Any = importlib.util.module_from_spec(_SPEC)  # type: ignore[arg-type]
_SPEC.loader.exec_module(cases)  # type: ignore[union-attr]


def _init(**config: Any) -> None:
    if smp.is_initialized():
        smp.shutdown()
    smp.init({"partitions": 1, "microbatches": 1, **config})


def _train(name: str, adam: bool, init: list[np.ndarray], one_call: bool = True
           ) -> tuple[list[float], list[np.ndarray], Any]:
    x, y = cases.data(name, cases.STEPS * cases.BATCH)
    model = cases.build(name)
    model.set_weights(init)
    dm = smp.DistributedModel(model)
    dm.compile(optimizer=cases.optimizer_of(adam), loss=cases.loss_of(name))
    if not one_call:
        dm.partition(cases.rows(x, 0, cases.BATCH))
        dm._engine._one_call = False  # the executor path, for comparison
    b = cases.BATCH
    losses = [cases._first(dm.train_on_batch(cases.rows(x, i * b, (i + 1) * b),
                                             cases.rows(y, i * b, (i + 1) * b)))
              for i in range(cases.STEPS)]
    return losses, dm.get_weights(), dm._engine


@pytest.mark.parametrize("name,adam", [("mlp", True), ("multiio", False), ("bn", False),
                                       ("drop", False), ("embed", True)])
def test_one_call_step_equals_plain_keras_and_the_executor_path(name: str, adam: bool) -> None:
    _init()
    try:
        x, y = cases.data(name, cases.STEPS * cases.BATCH)
        ref = cases.build(name)
        init = ref.get_weights()
        ref.compile(optimizer=cases.optimizer_of(adam), loss=cases.loss_of(name))
        b = cases.BATCH
        ref_losses = [cases._first(ref.train_on_batch(cases.rows(x, i * b, (i + 1) * b),
                                                      cases.rows(y, i * b, (i + 1) * b)))
                      for i in range(cases.STEPS)]
        losses, weights, engine = _train(name, adam, init)
        assert isinstance(engine._one_call, OneCallStep) and engine._executor is None
        np.testing.assert_allclose(losses, ref_losses, rtol=cases.RTOL, atol=cases.ATOL)
        for w, r in zip(weights, ref.get_weights()):
            np.testing.assert_allclose(w, r, rtol=cases.RTOL, atol=cases.ATOL)
        old_losses, old_weights, old_engine = _train(name, adam, init, one_call=False)
        assert old_engine._executor is not None
        assert losses == old_losses
        assert all(np.array_equal(a, c) for a, c in zip(weights, old_weights))
    finally:
        smp.shutdown()


def _mlp() -> Any:
    dm = smp.DistributedModel(cases.build("mlp"))
    dm.compile(optimizer=cases.optimizer_of(True), loss="mse")
    return dm


def test_non_finite_step_raises_or_skips_without_changing_any_variable() -> None:
    x, y = cases.data("mlp", 32)
    bad_y = y[:16].copy()
    bad_y[3, 0] = np.inf
    try:
        _init()
        dm = _mlp()
        dm.train_on_batch(x[:16], y[:16])
        before = dm.get_weights()
        with pytest.raises(StepError, match=r"Non-finite values at step 2: loss of "
                           r"microbatch\(es\) \[0\] on the last stage; gradients of stage 0 "
                           r"from microbatch 0\. .*nonfinite='skip'"):
            dm.train_on_batch(x[16:], bad_y)
        assert all(np.array_equal(a, b) for a, b in zip(before, dm.get_weights()))
        assert int(dm.optimizer.iterations) == 1
        _init(nonfinite="skip")
        dm = _mlp()
        dm.train_on_batch(x[:16], y[:16])
        before = dm.get_weights()
        dm.train_on_batch(x[16:], bad_y)
        assert all(np.array_equal(a, b) for a, b in zip(before, dm.get_weights()))
        assert dm._engine.skipped_steps == 1 and int(dm.optimizer.iterations) == 1
        dm.train_on_batch(x[16:], y[16:])
        assert not all(np.array_equal(a, b) for a, b in zip(before, dm.get_weights()))
        # a fit with Keras's TerminateOnNaN applies the non-finite update, as plain Keras does
        _init()
        dm = _mlp()
        ref = cases.build("mlp")
        ref.set_weights(dm.get_weights())
        ref.compile(optimizer=cases.optimizer_of(True), loss="mse")
        data = (x[:32], np.concatenate([y[:16], bad_y]))
        for model in (dm, ref):
            model.fit(*data, batch_size=16, shuffle=False, verbose=0,
                      callbacks=[keras.callbacks.TerminateOnNaN()])
        assert int(dm.optimizer.iterations) == int(ref.optimizer.iterations) == 2
        assert all(np.array_equal(a, b, equal_nan=True)
                   for a, b in zip(ref.get_weights(), dm.get_weights()))
    finally:
        smp.shutdown()


def test_the_one_call_step_updates_variable_by_variable_where_the_pipeline_would() -> None:
    """[Note: one-call direct update]: Adam under nonfinite='raise' updates each variable under
    its own gradient's flag, so a gradient that is not finite under a finite loss (sqrt's at
    zero) leaves that variable as it was, updates the others, and the error says so; 'skip'
    keeps the all-or-nothing step, and a global clipnorm (every gradient before any update)
    keeps it too."""
    x = np.ones((8, 4), np.float32)
    y = np.ones((8, 2), np.float32)

    def model() -> Any:
        inputs = keras.Input((4,))
        h = keras.layers.Dense(3, kernel_initializer="zeros", name="first")(inputs)
        h = keras.layers.Lambda(lambda t: keras.ops.sqrt(keras.ops.abs(t)))(h)
        return keras.Model(inputs, keras.layers.Dense(2, name="last")(h))

    try:
        # Keras's MultiOptimizer updates in its sub-optimizers, where the per-variable check
        # cannot reach: before, its non-finite gradient went unchecked and was applied
        multi = keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(0.1), {"first/.*": keras.optimizers.Adam()}))
        for config, optimizer, direct in [({}, "adam", True), ({"nonfinite": "skip"}, "adam", False),
                                          ({}, keras.optimizers.Adam(global_clipnorm=1.0), False),
                                          ({}, multi, False)]:
            _init(**config)
            dm = smp.DistributedModel(model())
            dm.compile(optimizer=optimizer, loss="mse")
            before = dm.get_weights()
            if config:
                dm.train_on_batch(x, y)
            else:
                with pytest.raises(StepError, match="variables with finite gradients were "
                                   "updated" if direct else r"gradients of stage 0 from"):
                    dm.train_on_batch(x, y)
            assert dm._engine._one_call.direct is direct
            after = dm.get_weights()
            assert np.array_equal(before[0], after[0])  # first kernel: non-finite gradient
            # the last layer's bias has a finite gradient: updated only variable by variable
            assert np.array_equal(before[3], after[3]) is not direct
    finally:
        smp.shutdown()


def test_a_traced_one_call_step_records_a_forward_and_a_step_span(tmp_path: Path) -> None:
    from tfsmp.timeline.events import load_events

    x, y = cases.data("mlp", 32)
    try:
        _init(trace_dir=str(tmp_path))
        dm = _mlp()
        dm.fit(x, y, batch_size=16, epochs=1, verbose=0)
        dm._engine._tracer.flush()
    finally:
        smp.shutdown()
    events = load_events(str(tmp_path))
    assert [(e["name"], e["kind"]) for e in events] == [("0F0", "F"), ("0STEP", "STEP")] * 2


def test_the_finiteness_check_is_exact_even_when_a_sum_overflows() -> None:
    big = tf.fill([4], 3e38)  # finite, but its sum overflows float32
    nan = tf.constant([1.0, np.nan])
    inf = tf.constant([np.inf, -np.inf])
    sparse = tf.IndexedSlices(tf.constant([[1.0, np.nan]]), tf.constant([0]), tf.constant([3, 2]))
    check = tf.function(all_finite)
    assert bool(check([big, tf.ones([2])]))
    assert not bool(check([big, nan]))
    assert not bool(check([tf.ones([2]), inf]))
    assert not bool(check([sparse]))
    assert bool(check([]))


@pytest.mark.parametrize("metrics", [None, {"cls": ["accuracy"]}])
def test_a_steps_logs_are_keras_get_metrics_result_and_keras_fits_logs(metrics: Any) -> None:
    """[Note: logs in the loss means' call] in tfsmp/keras/trainer_metrics.py: without compiled
    metrics the loss means' compiled call returns the logs; with them, Keras's method is read
    after their update. Either way: Keras's keys, in its order, and plain Keras's values."""
    x, y = cases.data("multiio", 2 * cases.BATCH)  # several outputs: a loss Mean per output
    try:
        _init()
        ref = cases.build("multiio")
        dm = smp.DistributedModel(cases.build("multiio"))
        dm.set_weights(ref.get_weights())
        hist = []
        for model in (ref, dm):
            model.compile(optimizer=cases.optimizer_of(True), loss=cases.loss_of("multiio"),
                          metrics=metrics)
            hist.append(model.fit(x, y, batch_size=cases.BATCH, shuffle=False, verbose=0).history)
        logs = dm.train_function(iter([(cases.rows(x, 0, cases.BATCH),
                                        cases.rows(y, 0, cases.BATCH))]))
        read = dm.get_metrics_result()
        means = dm.train_function.__self__.metrics
        assert means._loss_key[0] is (metrics is None)  # the logs came from the compiled call
    finally:
        smp.shutdown()
    assert list(logs) == list(read)
    assert all(float(logs[k]) == float(read[k]) for k in read)
    assert list(hist[0]) == list(hist[1])
    for k in hist[0]:
        np.testing.assert_allclose(hist[1][k], hist[0][k], rtol=cases.RTOL, atol=cases.ATOL)
