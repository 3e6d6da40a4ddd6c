"""`@smp.step` and `StepOutput` in a world of one (4 microbatches): every method, the split
options, eager vs tf.function-wrapped calls, and the errors SMP documents."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfsmp as smp
from tfsmp.errors import StepError

pytestmark = pytest.mark.tf
M = 4


@pytest.fixture(scope="module", autouse=True)
def world() -> None:
    if smp.is_initialized():
        smp.shutdown()
    smp.init({"partitions": 1, "microbatches": M})
    yield
    smp.shutdown()


class Net(smp.DistributedModel):
    def __init__(self) -> None:
        super().__init__()
        self.d1 = keras.layers.Dense(8, activation="tanh", name="s_d1")
        self.d2 = keras.layers.Dense(3, name="s_d2")

    def call(self, x, training=None):  # type: ignore[no-untyped-def]
        return self.d2(self.d1(x))


@pytest.fixture(scope="module")
def model() -> Net:
    keras.utils.set_random_seed(0)
    return Net()


X = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 3, size=8)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_step_output_methods() -> None:
    parts = [tf.constant([[1.0, 2.0]]), tf.constant([[3.0, 4.0]])]
    out = smp.StepOutput(parts)
    assert out.outputs == parts
    np.testing.assert_allclose(out.reduce_mean(), [[2.0, 3.0]])
    np.testing.assert_allclose(out.reduce_sum(), [[4.0, 6.0]])
    np.testing.assert_allclose(out.concat(), [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(out.merge(), [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(out.stack(), [[[1.0, 2.0]], [[3.0, 4.0]]])
    for method in ("variable", "add_n", "accumulate_n"):
        np.testing.assert_allclose(out.accumulate(method), [[2.0, 3.0]])
    var = tf.Variable(tf.zeros((1, 2)))
    assert out.accumulate(var=var) is var
    np.testing.assert_allclose(var.numpy(), [[2.0, 3.0]])
    with pytest.raises(StepError, match="accumulate's method must be one of"):
        out.accumulate("mean")


def test_step_splits_into_microbatches_and_matches_full_batch(model: Net) -> None:
    @smp.step
    def fwd_bwd(x, y):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = LOSS(y, logits)
        return tape.gradient(loss, model.trainable_variables), loss, logits

    grads, loss, logits = fwd_bwd(tf.constant(X), tf.constant(Y))
    assert len(loss.outputs) == M and logits.merge().shape == (8, 3)
    with tf.GradientTape() as tape:
        ref_logits = model._engine.traced(X)
        ref_loss = LOSS(Y, ref_logits)
    ref_grads = tape.gradient(ref_loss, model.trainable_variables)
    np.testing.assert_allclose(loss.reduce_mean(), ref_loss, rtol=1e-6)
    np.testing.assert_allclose(logits.merge(), ref_logits, rtol=1e-6, atol=1e-7)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.accumulate(), r, rtol=1e-5, atol=1e-7)


def test_eager_and_tf_function_calls_give_identical_results(model: Net) -> None:
    @smp.step
    def fwd_bwd(x, y):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables), loss

    eager_grads, eager_loss = fwd_bwd(tf.constant(X), tf.constant(Y))

    @tf.function
    def outer(x, y):  # type: ignore[no-untyped-def]
        grads, loss = fwd_bwd(x, y)
        return [g.outputs for g in grads], [g.accumulate() for g in grads], loss.outputs

    per_mb_grads, grads, per_mb = outer(tf.constant(X), tf.constant(Y))
    # the pipeline's results are bit-identical; reductions done inside a graph may be reordered
    assert [float(v) for v in per_mb] == [float(v) for v in eager_loss.outputs]
    for graph_mbs, eager in zip(per_mb_grads, eager_grads):
        for a, b in zip(graph_mbs, eager.outputs):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(grads, eager_grads):
        np.testing.assert_allclose(a.numpy(), b.accumulate().numpy(), rtol=1e-6, atol=1e-8)


def test_non_split_inputs_and_input_split_axes(model: Net) -> None:
    seen: list[tuple[int, ...]] = []

    @smp.step(non_split_inputs=["scale"], input_split_axes={"xt": 1})
    def fwd(xt, scale):  # type: ignore[no-untyped-def]
        seen.append((tuple(xt.shape), tuple(np.shape(scale))))
        return model(tf.transpose(xt), training=False) * scale

    out = fwd(tf.constant(X.T), tf.constant([2.0, 2.0, 2.0]))
    assert (X.T.shape[0], 2) in [s[0] for s in seen]        # split along axis 1
    assert all(s[1] == (3,) for s in seen)                   # passed whole
    np.testing.assert_allclose(out.merge(), model._engine.traced(X) * 2.0, rtol=1e-6, atol=1e-7)


def test_documented_errors(model: Net) -> None:
    with pytest.raises(StepError, match=r"may be called only inside an smp\.step"):
        model(X)
    with pytest.raises(StepError, match="Set the `xla` parameter instead"):
        smp.step(jit_compile=True)(lambda x: x)

    @smp.step
    def no_model(x):  # type: ignore[no-untyped-def]
        return x * 2

    with pytest.raises(StepError, match="must call the DistributedModel"):
        no_model(tf.constant(X))

    @smp.step
    def fwd(x):  # type: ignore[no-untyped-def]
        return model(x)

    with pytest.raises(StepError, match="batch size must be divisible by microbatches"):
        fwd(tf.constant(X[:6]))
    with pytest.raises(StepError, match="name the step's arguments"):
        smp.step(non_split_inputs=["nope"])(lambda x: x)
