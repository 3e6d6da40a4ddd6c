"""The B/W split of `tfsmp.runtime.deferred` gives the gradients of one whole backward.

B (gradients for the inputs and the deferred layers' pre-activations, via zero slots) followed by
W (weight gradients from the saved layer inputs) must equal `tape.gradient` of the same model
for every variable and the input, at float32 round-off (rtol 1e-5, atol 1e-6), for Dense,
EinsumDense nested in MultiHeadAttention, a layer called twice, a kernel that another op also
reads, and mixed_float16. B must not build the deferred weight gradients at all.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfsmp.runtime import deferred

pytestmark = pytest.mark.tf
RTOL, ATOL = 1e-5, 1e-6


class _ReadsKernel(keras.layers.Layer):
    """Adds a term that reads another layer's kernel: that kernel gets gradient from B too."""

    def __init__(self, dense: keras.layers.Dense, **kw: object) -> None:
        super().__init__(**kw)
        self.dense = dense

    def call(self, x: tf.Tensor) -> tf.Tensor:
        return x + 0.1 * tf.reduce_sum(self.dense.kernel)


def _model(kind: str) -> keras.Model:
    keras.utils.set_random_seed(3)
    L = keras.layers
    inp = keras.Input((6, 16))
    if kind == "mha":
        h = L.Dense(32, activation="relu")(inp)
        h = L.MultiHeadAttention(2, 8)(h, h)
        h = L.LayerNormalization()(h)
        return keras.Model(inp, L.Dense(16, activation="gelu")(h))
    if kind == "shared":
        shared = L.Dense(16, activation="tanh")
        return keras.Model(inp, L.Dense(4)(shared(L.Dense(16)(shared(inp)))))
    if kind == "extra":
        d = L.Dense(16, activation="tanh")
        return keras.Model(inp, L.Dense(4)(_ReadsKernel(d)(d(inp))))
    raise ValueError(kind)


def _reference(model: keras.Model, x: tf.Tensor, dy: tf.Tensor) -> list[tf.Tensor]:
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = model(x, training=True)
    return tape.gradient(out, [x] + [v.value for v in model.trainable_variables],
                         output_gradients=tf.cast(dy, out.dtype))


def _split(model: keras.Model, x: tf.Tensor, dy: tf.Tensor) -> tuple[list[tf.Tensor], int, str]:
    deferred.install()
    rec = deferred.discover(lambda: model(x, training=True))
    slots = [tf.zeros(s, d) for s, d in zip(rec.shapes, rec.dtypes)]

    @tf.function
    def forward(x: tf.Tensor, slots: list[tf.Tensor]) -> tuple[tf.Tensor, list[tf.Tensor]]:
        with deferred.recording(slots) as r:
            out = model(x, training=True)
        return out, r.xs

    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        tape.watch(x)
        tape.watch(slots)
        out, xs = forward(x, slots)
    grads = tape.gradient(out, [x, *slots, *(v.value for v in variables)],
                          output_gradients=tf.cast(dy, out.dtype),
                          unconnected_gradients=tf.UnconnectedGradients.NONE)
    dx, dys, b_grads = grads[0], grads[1:1 + len(slots)], grads[1 + len(slots):]

    @tf.function
    def weight(xs: list[tf.Tensor], dys: list[tf.Tensor]) -> list[tf.Tensor]:
        return [g for _, g in deferred.weight_gradients(rec.layers, xs, dys)]

    w_grads = weight(xs, dys)
    total = {id(v): g for v, g in zip(variables, b_grads) if g is not None}
    for (v, _), g in zip(deferred.weight_gradients(rec.layers, xs, dys), w_grads):
        total[id(v)] = total[id(v)] + g if id(v) in total else g
    graph = forward.get_concrete_function(x, slots).graph
    return [dx] + [total[id(v)] for v in variables], len(rec.layers), graph.as_graph_def().node


def _close(got: list[tf.Tensor], want: list[tf.Tensor]) -> None:
    # ATOL at the tensor's scale: B then W sums a gradient in another order than one backward,
    # and an element near zero in a tensor of magnitude ~5 then differs by a few float32 ulps of
    # that magnitude (measured on this machine: mha's largest difference 1.05e-6 beside values
    # up to 5.3, on 391de69 as well)
    for g, w in zip(got, want):
        want_np = np.asarray(w, np.float32)
        scale = max(1.0, float(np.max(np.abs(want_np)))) if want_np.size else 1.0
        np.testing.assert_allclose(np.asarray(g, np.float32), want_np, rtol=RTOL,
                                   atol=ATOL * scale)


@pytest.mark.parametrize(("kind", "calls"), [("mha", 6), ("shared", 4), ("extra", 2)])
def test_b_then_w_equals_one_backward(kind: str, calls: int) -> None:
    model = _model(kind)
    x = tf.random.stateless_normal((4, 6, 16), seed=(1, 2))
    out_shape = model.output.shape[1:]
    dy = tf.random.stateless_normal((4, *out_shape), seed=(3, 4))
    got, found, _ = _split(model, x, dy)
    assert found == calls  # every Dense call, and MultiHeadAttention's four EinsumDense
    _close(got, _reference(model, x, dy))


def test_mixed_float16() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model("mha")
        x = tf.random.stateless_normal((4, 6, 16), seed=(1, 2))
        dy = tf.random.stateless_normal((4, 6, 16), seed=(3, 4))
        got, found, _ = _split(model, x, dy)
        want = _reference(model, x, dy)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert found == 6
    for g, w in zip(got, want):  # float16 compute: compare at float16's precision
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=3e-2, atol=2e-2)


def test_b_has_no_weight_gradient_matmul() -> None:
    """With the kernel behind stop_gradient, B's backward has only dX's MatMul per Dense."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((64,))
    model = keras.Model(inp, keras.layers.Dense(32)(keras.layers.Dense(64, activation="relu")(inp)))
    x = tf.random.stateless_normal((8, 64), seed=(1, 2))
    deferred.install()
    rec = deferred.discover(lambda: model(x, training=True))
    slots = [tf.zeros(s, d) for s, d in zip(rec.shapes, rec.dtypes)]

    def b_step(x: tf.Tensor, slots: list[tf.Tensor]) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            tape.watch(slots)
            with deferred.recording(slots):
                out = model(x, training=True)
        return tape.gradient(out, [x, *slots], output_gradients=tf.ones_like(out))

    graph = tf.function(b_step).get_concrete_function(x, slots).graph
    matmuls = [op for op in graph.get_operations() if op.type in ("MatMul", "BatchMatMulV3")]
    # 2 forward matmuls + 1 input-gradient matmul for the second Dense (the first Dense's
    # input is the model input x, whose gradient is asked for: +1) -- and no x^T·dy
    assert len(matmuls) == 4, [op.name for op in matmuls]
    full = tf.function(lambda x: tf.gradients(model(x, training=True), [x, *(
        v.value for v in model.trainable_variables)])).get_concrete_function(x).graph
    assert sum(op.type == "MatMul" for op in full.get_operations()) == 6  # + the two x^T·dy


def test_outside_a_recorder_dense_calls_keras_own_call() -> None:
    deferred.install()
    layer = keras.layers.Dense(8, activation="relu")
    x = tf.random.stateless_normal((4, 16), seed=(1, 2))
    y = layer(x)
    original = deferred._ORIGINAL[keras.layers.Dense]
    assert keras.layers.Dense.call is not original  # installed
    assert np.array_equal(np.asarray(y), np.asarray(original(layer, x)))
