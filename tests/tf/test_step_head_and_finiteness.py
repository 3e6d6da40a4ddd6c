"""Issue 30's per-step overheads, in one process: what a rank converts ([Note: what a rank
converts] in tfsmp/runtime/batching.py) and the finiteness checked once per stage and step
([Note: finite flags] in tfsmp/runtime/stage.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
pytestmark = pytest.mark.tf


def test_split_rows_cuts_tensors_and_views_numpy_arrays() -> None:
    from tfsmp.runtime.batching import split_rows

    a = np.arange(20, dtype=np.float32).reshape(10, 2)
    t = tf.constant(a)
    parts = split_rows({"t": t, "a": a, "none": None}, [4, 3, 3])
    assert [p["t"].shape[0] for p in parts] == [4, 3, 3]
    np.testing.assert_array_equal(np.concatenate([p["t"].numpy() for p in parts]), a)
    assert all(np.shares_memory(p["a"], a) for p in parts)  # views, no copy
    assert all(p["none"] is None for p in parts)
    assert split_rows(None, [2, 2]) == [None, None]
    one = {"t": t}
    assert split_rows(one, [10])[0] is one


def _traced() -> tuple[Any, list[str]]:
    from tfsmp.graph.tracer import trace

    keras.utils.set_random_seed(0)
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    out = keras.layers.Dense(1, name="d")(keras.layers.Concatenate()([a, b]))
    traced = trace(keras.Model([a, b], out))
    return traced, traced.input_keys


def test_a_rank_converts_only_what_its_stages_read() -> None:
    from tfsmp.runtime.batching import Batching

    traced, keys = _traced()
    x = [np.ones((8, 3), np.float32), np.ones((8, 2), np.float32)]
    y = np.zeros((8, 1), np.float32)
    every = Batching(traced, data_rank=0, data_size=1, microbatches=2, rank_tag="[t]")
    some = Batching(traced, data_rank=0, data_size=1, microbatches=2, rank_tag="[t]",
                    reads={keys[1]}, labels=False)
    shape = every.step_shape(8)
    full = every.microbatches(x, y, None, shape)
    part = some.microbatches(x, y, None, shape)
    assert all(isinstance(mb.inputs[k], tf.Tensor) for mb in full for k in keys)
    assert all(isinstance(mb.y, tf.Tensor) for mb in full)
    for mb in part:  # the unread input stays a view of the batch, with its shape
        assert isinstance(mb.inputs[keys[0]], np.ndarray) and mb.inputs[keys[0]].shape == (4, 3)
        assert np.shares_memory(mb.inputs[keys[0]], x[0])
        assert isinstance(mb.inputs[keys[1]], tf.Tensor) and mb.y is None
    # constants are made once per distinct value
    assert full[0].consts is full[1].consts
    assert every.microbatches(x, y, None, shape)[0].consts is full[0].consts


def _state(values: list[np.ndarray]) -> Any:
    from tfsmp.runtime.gradients import GradientStore

    variables = [tf.Variable(np.zeros_like(v)) for v in values]
    store = GradientStore(stage=0, trainable=variables)
    state = store.step()
    for acc, v in zip(state.accumulators, values):
        acc.assign(v)
    return state


def test_finiteness_is_decided_once_and_the_microbatch_named_from_its_inputs() -> None:
    good = [np.ones((2, 2), np.float32), np.ones(2, np.float32)]
    bad = [np.ones((2, 2), np.float32), np.array([1.0, np.inf], np.float32)]
    state = _state(good)
    state.take_fresh()
    state.add_hint(0, tf.constant(True))
    state.add_hint(1, tf.constant(False))  # inputs not finite, gradients are: the step is fine
    assert state.finite_status() == (True, None)
    state = _state(bad)
    state.take_fresh()
    for i, ok in enumerate([True, False, False]):
        state.add_hint(i, tf.constant(ok))
    assert state.finite_status() == (False, 1)
    state = _state(bad)
    state.take_fresh()
    state.add_hint(0, tf.constant(True))
    assert state.finite_status() == (False, -1)  # overflowed on finite inputs: none to name
    state = _state(bad)  # a step that wrote nothing leaves stale values unread
    assert state.finite_status() == (True, None)
    state = _state(bad)
    state.take_fresh()
    state.add_flag(0, tf.constant(False))  # an exact verdict (taped, direct) names its own
    assert state.finite_status() == (False, 0)


def test_the_message_says_when_no_microbatch_can_be_named() -> None:
    from tfsmp.runtime.report import RankReport, StepReport

    report = StepReport([RankReport(np.zeros(0), finite=False, first_nonfinite={0: -1, 1: 2})])
    message = report.nonfinite_message("[t]", 3, direct=False)
    assert "stage 0 (every microbatch's inputs were finite), stage 1 from microbatch 2" in message
