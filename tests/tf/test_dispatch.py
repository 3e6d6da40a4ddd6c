"""[Note: program dispatch] in tfsmp/runtime/dispatch.py: a stage program, once traced for a
call signature, is called flat, with tf.function's results, gradients and retracing rules."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from tfsmp.runtime import dispatch
from tfsmp.runtime.dispatch import Program

pytestmark = pytest.mark.tf


def _counted(f: Any) -> tuple[Program, list[int]]:
    traces: list[int] = []

    def traced(*args: Any) -> Any:
        traces.append(1)
        return f(*args)

    return Program(tf.function(traced)), traces


def _flat_entries(p: Program) -> list[Any]:
    return [cf for cf in p._flat.values() if cf is not None]


def test_a_traced_signature_is_called_flat_with_the_same_results() -> None:
    w = tf.Variable([[1.0, 2.0], [3.0, 4.0]])

    def f(xs: list[tf.Tensor], extras: dict[str, tf.Tensor], scale: bool, none: Any) -> Any:
        out = xs[0] @ w + extras["b"] - extras["a"]
        return (out * 2.0 if scale else out), [x + 1.0 for x in xs]

    p, traces = _counted(f)
    ref = tf.function(f)
    x = [tf.constant([[1.0, 0.0]]), tf.constant([[0.0, 1.0]])]
    extras = {"b": tf.constant([1.0, 1.0]), "a": tf.constant([0.5, 0.0])}  # sorted: a, b
    for _ in range(3):
        w.assign_add(tf.ones_like(w))  # captured variables are read at each call
        got, want = p(x, extras, True, None), ref(x, extras, True, None)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1][1], want[1][1])
    assert len(traces) == 1 and len(_flat_entries(p)) == 1
    p(x, extras, False, None)  # a Python value is part of the signature: a new trace
    assert len(traces) == 2 and len(_flat_entries(p)) == 2
    p([tf.constant([[1.0, 0.0], [2.0, 0.0]]), x[1]], extras, False, None)  # a new shape
    assert len(traces) == 3


def test_gradients_through_a_flat_call_are_tf_functions() -> None:
    w = tf.Variable([[1.0, -2.0], [0.5, 3.0]])

    def f(x: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(tf.nn.relu(x @ w) ** 2)

    p = Program(tf.function(f))
    x = tf.constant([[1.0, 2.0]])
    p(x)  # traced and learnt; the next calls are flat
    for _ in range(2):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = p(x)
        gx, gw = tape.gradient(y, [x, w])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y2 = f(x)
        np.testing.assert_allclose(y, y2)
        for a, b in zip([gx, gw], tape.gradient(y2, [x, w])):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert len(_flat_entries(p)) == 1


def test_other_calls_take_tf_functions_own_path() -> None:
    p = Program(tf.function(lambda x, y=None: x * 2.0 if y is None else x * y))
    x = tf.constant([1.0, 2.0])
    p(x, y=tf.constant(3.0))  # keyword arguments
    v = tf.Variable([1.0, 1.0])
    np.testing.assert_array_equal(p(v), [2.0, 2.0])  # a variable
    np.testing.assert_array_equal(p(np.ones(2, np.float32)), [2.0, 2.0])  # NumPy
    assert not p._flat

    @tf.function
    def outer(x: tf.Tensor) -> tf.Tensor:  # called while a graph is built
        return p(x)

    p(x), p(x)
    np.testing.assert_array_equal(outer(x), [2.0, 4.0])


def test_a_signature_whose_inputs_differ_is_never_called_flat() -> None:
    """A default tensor argument is an input of the concrete function that the call's own
    arguments do not hold: the check finds it, and the call stays tf.function's."""
    two = tf.constant(2.0)
    p = Program(tf.function(lambda x, y=two: x * y))
    x = tf.constant([1.0, 2.0])
    for _ in range(3):
        np.testing.assert_array_equal(p(x), [2.0, 4.0])
    assert list(p._flat.values()) == [None]


def test_the_signature_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_CACHE", 3)
    p = Program(tf.function(lambda x: x + 1.0, reduce_retracing=True))
    for n in range(1, 8):
        np.testing.assert_array_equal(p(tf.zeros([n])), np.ones(n))
        assert len(p._flat) <= 3


def test_call_options_are_set_for_the_call_and_restored() -> None:
    from tensorflow.python.eager import context

    ctx = context.context()
    seen: list[Any] = []
    options = context.FunctionCallOptions(config_proto=ctx.config)
    p = Program(tf.function(lambda x: x), call_options=options)
    before = ctx.function_call_options
    for _ in range(2):
        seen.append(ctx.function_call_options)
        p(tf.constant(1.0))
        assert ctx.function_call_options is before
    inner = Program(tf.function(lambda x: (seen.append(ctx.function_call_options), x)[1]),
                    call_options=options)
    inner(tf.constant(1.0))
    assert seen[-1] is options


def test_flat_off_leaves_every_call_to_tf_function() -> None:
    """`benchmarks/dispatch.py`'s switch: a program with ``flat`` off learns no signature."""
    p, traces = _counted(lambda x: x * 3.0)
    p.flat = False
    for _ in range(3):
        np.testing.assert_array_equal(p(tf.constant([1.0])), [3.0])
    assert not p._flat and len(traces) == 1


def test_functions_run_eagerly_run_the_python_function() -> None:
    """`tf.config.run_functions_eagerly(True)` (debugging) runs every call as Python, learnt
    signatures included, as tf.function does."""
    p, traces = _counted(lambda x: x + 1.0)
    x = tf.constant([1.0])
    p(x), p(x)
    assert len(traces) == 1 and _flat_entries(p)
    tf.config.run_functions_eagerly(True)
    try:
        for _ in range(2):
            np.testing.assert_array_equal(p(x), [2.0])
    finally:
        tf.config.run_functions_eagerly(False)
    assert len(traces) == 3
    p(x)
    assert len(traces) == 3
