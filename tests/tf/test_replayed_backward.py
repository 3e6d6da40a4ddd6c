"""The compiled backward of `optimize: speed` gives the gradients of one whole backward.

A forward under a recorder returns every Dense/EinsumDense call's product; a backward that
reruns the model under a recorder replaying those products ([Note: replayed products] in
tfsmp/runtime/deferred.py) must give `tape.gradient`'s gradients for every variable and the
input (rtol 1e-5, atol 1e-6 at the tensor's scale), for Dense, EinsumDense nested in
MultiHeadAttention, a layer called twice and a kernel another op also reads; and the products
must really be replayed: perturbing one changes the gradients.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.tf.test_deferred_grads import _close, _model, _reference
from tfsmp.runtime import deferred

pytestmark = pytest.mark.tf


def _replayed(model: keras.Model, x: tf.Tensor, dy: tf.Tensor, bump: float = 0.0
              ) -> tuple[list[tf.Tensor], int]:
    deferred.install()

    @tf.function
    def forward(x: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        with deferred.recording(None) as rec:
            out = model(x, training=True)
        return out, rec.products

    @tf.function
    def backward(x: tf.Tensor, products: list[tf.Tensor], dy: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            with deferred.recording(None, replay=products):
                out = model(x, training=True)
        return tape.gradient(out, [x, *(v.value for v in model.trainable_variables)],
                             output_gradients=tf.cast(dy, out.dtype))

    _, products = forward(x)
    products = [p + bump if k == 0 else p for k, p in enumerate(products)]
    return backward(x, products, dy), len(products)


@pytest.mark.parametrize(("kind", "calls"), [("mha", 6), ("shared", 4), ("extra", 2)])
def test_replayed_backward_equals_one_backward(kind: str, calls: int) -> None:
    model = _model(kind)
    x = tf.random.stateless_normal((4, 6, 16), seed=(1, 2))
    dy = tf.random.stateless_normal((4, *model.output.shape[1:]), seed=(3, 4))
    got, found = _replayed(model, x, dy)
    assert found == calls
    _close(got, _reference(model, x, dy))


def test_the_products_are_replayed_not_recomputed() -> None:
    model = _model("shared")
    x = tf.random.stateless_normal((4, 6, 16), seed=(1, 2))
    dy = tf.random.stateless_normal((4, *model.output.shape[1:]), seed=(3, 4))
    got, _ = _replayed(model, x, dy, bump=1.0)
    want = _reference(model, x, dy)
    assert any(not np.allclose(np.asarray(g), np.asarray(w), rtol=1e-3) for g, w in zip(got, want))


def test_replayable_layers() -> None:
    dense = keras.layers.Dense(4)
    frozen = keras.layers.Dense(4)
    for layer in (dense, frozen):
        layer.build((None, 3))
    frozen.trainable = False
    conv = keras.layers.Conv1D(4, 3)
    conv.build((None, 8, 3))
    assert deferred.replayable(dense)
    assert not deferred.replayable(frozen)
    assert not deferred.replayable(conv)


def test_mixed_float16() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model("mha")
        x = tf.random.stateless_normal((4, 6, 16), seed=(1, 2))
        dy = tf.random.stateless_normal((4, 6, 16), seed=(3, 4))
        got, found = _replayed(model, x, dy)
        want = _reference(model, x, dy)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert found == 6
    for g, w in zip(got, want):  # float16 compute: compare at float16's precision
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=3e-2, atol=2e-2)
