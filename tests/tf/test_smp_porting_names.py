"""SMP's Keras 2 names on Keras 3 objects (`tfsmp.keras.porting`) and the metric finder of
`tfsmp.keras.step_metrics`, in a world of one (2 microbatches)."""

from __future__ import annotations

import types
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfsmp as smp
from tfsmp.errors import StepError
from tfsmp.keras.porting import CallableList
from tfsmp.keras.step_metrics import referenced_metrics

pytestmark = pytest.mark.tf
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module", autouse=True)
def world() -> None:
    if smp.is_initialized():
        smp.shutdown()
    smp.init({"partitions": 1, "microbatches": 2})
    yield
    smp.shutdown()


class Net(smp.DistributedModel):
    def __init__(self) -> None:
        super().__init__()
        self.d1 = keras.layers.Dense(3, name="pn_d1")

    def call(self, x, training=None):  # type: ignore[no-untyped-def]
        return self.d1(x)


def test_reset_states_variables_call_and_num_microbatches() -> None:
    metric = keras.metrics.Mean()
    metric.update_state(3.0)
    metric.reset_states()
    assert float(metric.result()) == 0.0
    opt = keras.optimizers.Adam()
    opt.build([keras.Variable(np.zeros(2, np.float32))])
    assert isinstance(opt.variables, CallableList)
    assert opt.variables() == list(opt.variables) and len(opt.variables) > 0
    assert smp.num_microbatches() == 2


def test_get_gradients_inside_step_equals_tape_and_raises_outside() -> None:
    keras.utils.set_random_seed(0)
    model = Net()
    opt = keras.optimizers.SGD(0.1)
    x = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    y = np.array([0, 1, 2, 1])

    @smp.step
    def get_grads(x, y):  # type: ignore[no-untyped-def]
        loss = LOSS(y, model(x, training=True))
        return opt.get_gradients(loss, model.trainable_variables), loss

    grads, _ = get_grads(tf.constant(x), tf.constant(y))
    with tf.GradientTape() as tape:
        losses = [LOSS(y[i:i + 2], model._engine.traced(x[i:i + 2])) for i in (0, 2)]
        ref = (losses[0] + losses[1]) / 2
    for g, r in zip(grads, tape.gradient(ref, model.trainable_variables)):
        np.testing.assert_allclose(g.accumulate(), r, rtol=1e-6, atol=1e-7)
    with pytest.raises(StepError, match=r"works only inside an smp.step function .*"
                                        r"tape\.gradient\(loss, params\)"):
        opt.get_gradients(tf.constant(1.0), model.trainable_variables)


def test_load_model_of_a_saved_model_directory(tmp_path: Path) -> None:
    module = tf.Module()
    module.v = tf.Variable(2.0)
    module.f = tf.function(lambda x: x * module.v, input_signature=[tf.TensorSpec([], tf.float32)])
    tf.saved_model.save(module, str(tmp_path / "sm"), signatures=module.f)
    loaded = tf.keras.models.load_model(str(tmp_path / "sm"))
    assert float(loaded.signatures["serving_default"](tf.constant(3.0))["output_0"]) == 6.0
    with pytest.raises(ValueError, match="File format not supported"):
        keras.models.load_model(str(tmp_path / "missing.txt"))


acc = keras.metrics.SparseCategoricalAccuracy()
table = {"loss": keras.metrics.Mean()}


def test_referenced_metrics_finds_globals_closures_containers_and_attributes() -> None:
    holder = types.SimpleNamespace(metric=keras.metrics.Mean(), value=keras.Variable(1.0))
    local = keras.metrics.Sum()

    def helper(y, p):  # type: ignore[no-untyped-def]
        acc(y, p)

    def body(x, y):  # type: ignore[no-untyped-def]
        helper(y, x)
        table["loss"](1.0)
        holder.metric(2.0)
        return local(3.0)

    found = [id(m) for m in referenced_metrics(body)]
    assert sorted(found) == sorted(id(m) for m in (acc, table["loss"], holder.metric, local))
    assert found == [id(m) for m in referenced_metrics(body)]  # the same order every time
