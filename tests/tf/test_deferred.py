"""Pins tfsmp.graph.deferred: Keras's private deferred-initialization API does what tfsmp needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import weakref

import keras
import models  # tests/tf/models.py (pytest puts this directory on sys.path)
import numpy as np
import pytest
import tensorflow as tf

from tfsmp.errors import StepError
from tfsmp.graph.deferred import deferred_scope, is_deferred, materialize, release

pytestmark = pytest.mark.tf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in a fresh process so RSS reflects only this work. oneDNN is off so that freed TF buffers
# go back to the OS (with it on, TF keeps them pooled; see tfsmp/graph/deferred.py).
_MEMORY_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import keras
    from tfsmp.graph.deferred import deferred_scope, is_deferred, materialize, release

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

    class Twice(keras.layers.Layer):   # no compute_output_shape: symbolic calls run a FuncGraph
        def call(self, x):
            return x * 2

    base = rss()
    with deferred_scope():
        x = keras.Input((4096,))
        h, dense = x, []
        for i in range(8):
            dense.append(keras.layers.Dense(
                4096, kernel_initializer=keras.initializers.GlorotUniform(seed=i)))
            h = dense[-1](h)
        model = keras.Model(x, h)
    built = rss()
    Twice()(keras.Input((4,)))            # a later top-level StatelessScope must not allocate
    later = rss()
    materialize(dense[0].weights + dense[1].weights)
    two = rss()
    states = [is_deferred(v) for v in model.weights]
    materialize(model.weights)
    everything = rss()
    release(model.weights)
    released = rss()
    print(json.dumps(dict(build=built - base, later=later - built, two=two - later,
                          all=everything - later, released=released - later, states=states)))
""")


@pytest.fixture(scope="module")
def memory() -> dict:
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "3",
           "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, REPO], env=env, check=True,
                         capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


MIB_PER_LAYER = 4096 * 4096 * 4 / 2**20  # 64 MiB of kernel per Dense(4096)


def test_deferred_build_allocates_nothing(memory: dict) -> None:
    assert memory["build"] < 16  # MiB, against 512 MiB of weights
    assert memory["later"] < 16  # a top-level StatelessScope exit did not initialize them


def test_materialize_allocates_exactly_the_chosen_variables(memory: dict) -> None:
    assert memory["states"] == [False] * 4 + [True] * 12
    # two kernels, plus at most one initializer temporary
    assert 2 * MIB_PER_LAYER - 8 < memory["two"] < 3 * MIB_PER_LAYER + 16
    assert 8 * MIB_PER_LAYER - 8 < memory["all"] < 9 * MIB_PER_LAYER + 32


def test_release_returns_the_memory(memory: dict) -> None:
    assert memory["released"] < MIB_PER_LAYER


def _values(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v) for v in model.weights]


def test_seeded_values_equal_an_eager_build_in_any_materialization_order() -> None:
    eager = _values(models.build_cnn(seed=3))
    with deferred_scope():
        model = models.build_cnn(seed=3)
    assert all(is_deferred(v) for v in model.variables)
    materialize(reversed(model.weights))
    materialize(model.variables)  # the rest (seed states); already-allocated ones are skipped
    assert not any(is_deferred(v) for v in model.variables)
    for a, b in zip(eager, _values(model)):
        np.testing.assert_array_equal(a, b)


def test_unseeded_values_follow_keras_set_random_seed() -> None:
    def build() -> keras.Model:
        x = keras.Input((6,))
        return keras.Model(x, keras.layers.Dense(3)(keras.layers.Dense(5)(x)))

    keras.utils.set_random_seed(11)
    eager = _values(build())
    keras.utils.set_random_seed(11)
    with deferred_scope():
        model = build()
    materialize(model.weights[2:])
    materialize(model.weights[:2])
    for a, b in zip(eager, _values(model)):
        np.testing.assert_array_equal(a, b)


def test_release_keeps_metadata_and_rematerializes_the_same_values() -> None:
    with deferred_scope():
        model = models.build_mlp(seed=4)
    materialize(model.weights)
    kernel = model.weights[0]
    before = np.asarray(kernel)
    storage = weakref.ref(kernel._value)
    path, shape, dtype = kernel.path, tuple(kernel.shape), kernel.dtype
    assert release([kernel]) == [kernel]
    assert storage() is None and is_deferred(kernel)
    assert (kernel.path, tuple(kernel.shape), kernel.dtype) == (path, shape, dtype)
    with pytest.raises(StepError, match=r"released on this rank .* variable '.*kernel'"):
        np.asarray(kernel)
    materialize([kernel])
    np.testing.assert_array_equal(before, np.asarray(kernel))


def test_an_eagerly_built_variable_cannot_come_back_after_release() -> None:
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    release(layer.weights)
    with pytest.raises(RuntimeError, match=r"Only a variable created deferred .* Received: variable"):
        materialize(layer.weights)


def test_materialize_inside_the_scope_is_refused() -> None:
    with deferred_scope():
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        with pytest.raises(RuntimeError, match=r"cannot be materialized inside"):
            materialize(layer.weights)
    materialize(layer.weights)
    assert not is_deferred(layer.kernel)


def test_a_released_variable_with_a_source_reads_the_holders_value_eagerly_only() -> None:
    """[Note: remote reads]: an eager read of a released variable returns what its source
    gives (the holder's current value), every read afresh; inside a compiled function it is
    refused; without a source it raises as before."""
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    kernel, bias = layer.kernel, layer.bias
    holder = {"value": np.full((3, 2), 1.5, "float32")}
    calls = []

    def source() -> np.ndarray:
        calls.append(1)
        return holder["value"]

    assert release([kernel, bias], {id(kernel): source}) == [kernel, bias]
    np.testing.assert_array_equal(np.asarray(kernel), holder["value"])
    holder["value"] = holder["value"] * 2
    np.testing.assert_array_equal(kernel.numpy(), np.full((3, 2), 3.0))
    assert len(calls) == 2 and is_deferred(kernel)  # no copy kept: a read asks again
    with pytest.raises(Exception, match="compiled function cannot read another stage's"):
        tf.function(lambda: tf.reduce_sum(kernel.value))()
    with pytest.raises(StepError, match=r"released on this rank .* variable '.*bias'"):
        np.asarray(bias)
    for assign in (kernel.assign, kernel.assign_add, kernel.assign_sub):
        with pytest.raises(StepError, match=r"assigned only on the rank that holds it.*"
                                            r"an assign to variable '.*kernel'"):
            assign(np.ones((3, 2), "float32"))


def test_a_deferred_variable_of_another_stage_reads_its_holder_not_its_initial_value() -> None:
    """A variable created deferred and never materialized here would read its initializer's
    values (stale after training); with a source it reads the holder's, and `materialize`
    still gives the initial values back."""
    with deferred_scope():
        model = models.build_mlp(seed=4)
    kernel = model.weights[0]
    assert is_deferred(kernel)
    initial = np.asarray(kernel)
    trained = initial + 1.0
    assert release([kernel], {id(kernel): lambda: trained}) == [kernel]
    np.testing.assert_array_equal(np.asarray(kernel), trained)
    materialize([kernel])
    np.testing.assert_array_equal(np.asarray(kernel), initial)
    kernel.assign(trained)  # held again: assignable
    np.testing.assert_array_equal(np.asarray(kernel), trained)
