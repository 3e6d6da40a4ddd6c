"""Deferred weight gradients: the B/W split of a backward that zero-bubble schedules run.

Example::

    install()                                   # once; Keras's Dense/EinsumDense consult the recorder
    with recording(slots) as rec:               # inside a traced stage forward
        y = dense_layer(x)                      # rec.xs[k] = x; y's pre-activation + slots[k]
    # B: tape.gradient(..., slots) gives each call's pre-activation gradient dy_k and no dW
    # W: weight_gradients(rec.calls, xs, dys) gives every deferred layer's dW from (x_k, dy_k)

[Note: split backward] Zero-bubble pipelines (Qi et al., 2023) split a stage's backward into B,
the gradients for the tensors the stage received (what the previous stage waits for), and W, the
weight gradients (which nothing downstream waits for, so a schedule runs them in its bubbles).
TensorFlow differentiates a compiled forward as one function call whose backward computes the
gradients of every input, weights included. So the split happens inside the layer: while a
recorder is active, Keras's ``Dense`` and ``EinsumDense`` (also those nested in other layers,
e.g. attention's projections) compute their linear part from ``stop_gradient``-ed weights plus a
zero *slot* tensor that the stage function takes as an input. In B, the gradient with respect to
a slot is exactly the gradient at that layer's pre-activation (``y = xW + b + 0``), and no weight
gradient is built: the path from the weights is cut, so TensorFlow never creates the
``xᵀ·dy`` matmul. W then computes ``dW = xᵀ·dy`` and ``db = Σ dy`` from the layer's saved input
``x`` and ``dy`` with the same ops backprop would use (MatMul's and Einsum's registered gradients;
the forward op they are derived from is dead code and pruned), so the weight gradients equal the
unsplit backward's. Other layers (normalization, embeddings, convolutions, LoRA or quantized
Dense) keep their weight gradients in B, as the zero-bubble paper does for non-linear layers.

A stage function with slots needs their shapes before it runs: `discover` traces the stage once
per input signature without running it and records each deferred call's pre-activation shape.

[Note: replayed products] The same recorder lets a stage's backward run as one compiled call
without recomputing its matrix products (`optimize: speed`, [Note: stashing] in stage.py). The
forward returns every recorded call's product ``x·W`` (``rec.products``) beside its outputs;
the backward runs the stage again under a recorder given those products as ``replay``, where
each recorded call's product is the stashed tensor, wrapped so that its gradients are the ones
backprop through ``x·W`` gives (MatMul's or Einsum's registered gradient, taken from the
recomputed ``x`` and the kernel; the forward op they derive from is dead code and pruned). Only
the cheap parts in between (bias, activation, normalization, element-wise ops) are recomputed,
so the backward costs about what a fused forward-backward call's backward half does, and the
gradient of an input nothing differentiates (the model's own inputs) is pruned with the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

__all__ = ["Recorder", "install", "recording", "replayable", "weight_gradients"]

_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "tfsmp_deferred_recorder", default=None)
_ORIGINAL: dict[type, Callable[..., Any]] = {}


@dataclass
class Recorder:
    """Deferred layer calls of one traced stage forward, in call order.

    ``slots`` None: discovery (record shapes, change nothing); else one zero tensor per call,
    added to its pre-activation (and the call's weights are cut from the gradient). ``replay``:
    each call's product taken from a forward's ``products`` ([Note: replayed products])."""

    slots: list[tf.Tensor] | None = None
    accept: Callable[[Any], bool] | None = None  # which eligible layers to defer
    replay: list[tf.Tensor] | None = None
    products: list[tf.Tensor] = field(default_factory=list)
    layers: list[Any] = field(default_factory=list)
    xs: list[tf.Tensor] = field(default_factory=list)
    shapes: list[tf.TensorShape] = field(default_factory=list)
    dtypes: list[tf.DType] = field(default_factory=list)

    def take(self, layer: Any, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        k = len(self.layers)
        self.layers.append(layer)
        self.xs.append(x)
        self.shapes.append(y.shape)
        self.dtypes.append(y.dtype)
        self.products.append(y)
        if self.slots is None:
            return y
        return y + tf.cast(self.slots[k], y.dtype)


@contextlib.contextmanager
def recording(slots: list[tf.Tensor] | None, accept: Callable[[Any], bool] | None = None,
              replay: list[tf.Tensor] | None = None) -> Iterator[Recorder]:
    rec = Recorder(slots, accept, replay)
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)


def replayable(layer: Any) -> bool:
    """Whether a recorder handles this layer's calls: a Dense or EinsumDense that `_eligible`
    accepts ([Note: replayed products])."""
    from keras.layers import Dense, EinsumDense

    return isinstance(layer, Dense | EinsumDense) and _eligible(layer)


def _eligible(layer: Any) -> bool:
    """Plain linear layers: no LoRA, no quantization, trainable kernel."""
    if getattr(layer, "quantization_mode", None) is not None or getattr(layer, "lora_enabled", False):
        return False
    kernel = getattr(layer, "_kernel", None)
    return kernel is not None and bool(getattr(kernel, "trainable", False)) and layer.trainable


def _linear(layer: Any, x: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
    from keras import ops
    from keras.layers import EinsumDense

    if isinstance(layer, EinsumDense):
        return ops.einsum(layer.equation, x, kernel)
    return ops.matmul(x, kernel)


def _split_call(self: Any, inputs: Any, training: Any = None) -> Any:
    rec = _ACTIVE.get()
    original = _ORIGINAL[_base_of(self)]
    if rec is None or not _eligible(self) or (rec.accept is not None and not rec.accept(self)):
        return original(self, inputs, training=training)
    from keras import ops

    x = ops.convert_to_tensor(inputs)
    cut: Callable[[Any], Any] = (tf.stop_gradient if rec.slots is not None  # split: no dW in B
                                 else _same)
    kernel = cut(ops.convert_to_tensor(self.kernel))
    if rec.replay is not None:  # [Note: replayed products]
        product = _replayed(self, x, kernel, rec.replay[len(rec.layers)])
    else:
        product = _linear(self, x, kernel)
    # The slot joins right after the product, before the bias: with ``+ bias + slot`` Grappler's
    # remapper fuses MatMul+Add+Add+Relu into a node the MLIR optimizer then rejects ("empty op
    # name"), and TensorFlow runs the whole stage function unoptimized.
    y = rec.take(self, x, product)
    if self.bias is not None:
        y = ops.add(y, cut(ops.convert_to_tensor(self.bias)))
    if self.activation is not None:
        y = self.activation(y)
    return y


def _same(t: Any) -> Any:
    return t


def _replayed(layer: Any, x: tf.Tensor, kernel: tf.Tensor, product: tf.Tensor) -> tf.Tensor:
    """``product`` (a forward's ``x·kernel``) with the gradients of ``x·kernel``."""

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    def replayed(x: tf.Tensor, kernel: tf.Tensor) -> Any:
        def grad(dy: tf.Tensor) -> list[tf.Tensor]:
            with tf.GradientTape() as tape:
                tape.watch([x, kernel])
                y = _linear(layer, x, kernel)  # dead code but for its gradient: pruned
            return tape.gradient(y, [x, kernel], output_gradients=tf.cast(dy, y.dtype))  # type: ignore[no-any-return]

        return tf.identity(tf.cast(product, x.dtype)), grad

    return replayed(x, kernel)


def _base_of(layer: Any) -> type:
    for cls in type(layer).__mro__:
        if cls in _ORIGINAL:
            return cls
    raise TypeError(f"{type(layer).__name__} is not a deferred-gradient layer")


def install() -> None:
    """Routes Keras's Dense and EinsumDense calls through the recorder (a no-op while none is
    active, so models outside zero-bubble stage functions are unaffected). Idempotent."""
    from keras.layers import Dense, EinsumDense

    for cls in (Dense, EinsumDense):
        if cls not in _ORIGINAL:
            _ORIGINAL[cls] = cls.call
            cls.call = _split_call


def discover(run: Callable[[], Any], accept: Callable[[Any], bool] | None = None) -> Recorder:
    """The deferred calls ``run`` makes, found by tracing it once without running it."""
    found: list[Recorder] = []

    def traced() -> Any:
        with recording(None, accept) as rec:
            out = run()
        found.append(rec)
        return out

    tf.function(traced).get_concrete_function()
    return found[-1]


def _bias_gradient(dy: tf.Tensor, bias_shape: tf.TensorShape) -> tf.Tensor:
    """Σ dy over the axes the bias was broadcast along."""
    lead = dy.shape.rank - bias_shape.rank
    g = tf.reduce_sum(dy, axis=list(range(lead))) if lead > 0 else dy
    axes = [i for i, d in enumerate(bias_shape) if d == 1 and g.shape[i] != 1]
    return tf.reduce_sum(g, axis=axes, keepdims=True) if axes else g


def weight_gradients(layers: list[Any], xs: list[tf.Tensor], dys: list[tf.Tensor]
                     ) -> list[tuple[Any, tf.Tensor]]:
    """``[(variable, gradient), ...]`` of every deferred call's kernel and bias, call order
    (a layer called twice appears twice; the caller sums). Call inside a tf.function."""
    out: list[tuple[Any, tf.Tensor]] = []
    for layer, x, dy in zip(layers, xs, dys):
        kernel = layer._kernel
        with tf.GradientTape() as tape:
            k = tf.convert_to_tensor(kernel.value)
            tape.watch(k)
            y = _linear(layer, x, tf.cast(k, x.dtype))
        dy = tf.cast(dy, y.dtype)
        out.append((kernel, tf.cast(tape.gradient(y, k, output_gradients=dy), kernel.dtype)))
        if layer.bias is not None:
            bias = layer.bias
            out.append((bias, tf.cast(_bias_gradient(dy, tf.TensorShape(bias.shape)), bias.dtype)))
    return out
